"""Trainers that drive agentloop as their rollout backend.

``agentloop.integrations.trl``: TRL's ``GRPOTrainer`` (``pip install 'agentloop[trl]'``;
docs/trl.md).
Nothing is imported here, so ``import agentloop.integrations`` never needs a trainer library.
"""
