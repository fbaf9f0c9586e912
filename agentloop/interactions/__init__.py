"""Interactions: simulated users selected per sample by ``extra_info.interaction_kwargs.name``."""

from agentloop.interactions.answer_check import AnswerCheckInteraction
from agentloop.interactions.base import BaseInteraction
from agentloop.interactions.registry import (
    INTERACTIONS,
    get_interaction_class,
    initialize_interactions_from_config,
    register_interaction,
)

__all__ = ["INTERACTIONS", "AnswerCheckInteraction", "BaseInteraction", "get_interaction_class",
           "initialize_interactions_from_config", "register_interaction"]
