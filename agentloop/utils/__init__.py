"""Small verl-shaped utility modules (``agentloop.utils.tensordict_utils`` mirrors
``verl.utils.tensordict_utils``)."""
