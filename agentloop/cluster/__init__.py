"""Cluster lifecycle of the rollout servers: placement of standalone servers, colocation beside a
trainer's workers, supervision (restart of dead or hung servers) and the vLLM engine watch."""
