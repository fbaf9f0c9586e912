"""The batch: :class:`~agentloop.batch.protocol.DataProto` and its helpers, padding rollouts into
verl's layout (:mod:`~agentloop.batch.postprocess`), batch metrics, dataset loading, GRPO grouping
and multimodal columns."""
