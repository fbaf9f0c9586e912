"""Look inside a finished rollout: ``agentloop report`` (plots + HTML) and ``agentloop verify``
(log-prob and chat-template fidelity against the HF model).

Both read only what ``agentloop rollout`` wrote to its output directory
(:mod:`agentloop.report.outputs`). This package's ``__init__`` imports nothing heavy: the router
imports :mod:`agentloop.report.timing` on every worker, and matplotlib / transformers are imported
only inside the functions that draw or recompute.
"""
