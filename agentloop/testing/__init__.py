"""Public test helpers: a scripted fake engine and a dependency-free fake tokenizer.

``agentloop.testing.tiny_model`` (imported on demand) builds the tiny local model used by the demo
and the integration tests.
"""

from agentloop.testing.fake_tokenizer import FakeTokenizer
from agentloop.testing.scripted import ScriptedServer

__all__ = ["FakeTokenizer", "ScriptedServer"]
