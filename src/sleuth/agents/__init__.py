"""Agents: one ``async def`` per method over one example; the runner drives many at once."""

from sleuth.agents.base import AGENTS, AgentSpec, Context, format_passages, get_agent, load_prompt, register_agent

__all__ = ["AGENTS", "AgentSpec", "Context", "format_passages", "get_agent", "load_prompt", "register_agent"]
