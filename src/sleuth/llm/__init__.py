"""LLM backends behind one async interface (see :mod:`sleuth.llm.base`)."""

from sleuth.llm.base import (
    LLM,
    Generation,
    LLMError,
    LLMStats,
    Messages,
    ReplayLLM,
    Request,
    Sampling,
    Score,
    load_llm,
    parse_spec,
    register_backend,
)

__all__ = [
    "LLM",
    "Generation",
    "LLMError",
    "LLMStats",
    "Messages",
    "ReplayLLM",
    "Request",
    "Sampling",
    "Score",
    "load_llm",
    "parse_spec",
    "register_backend",
]
