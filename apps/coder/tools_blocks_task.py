"""The code tools server (tools_env.py) for a model without a tool-call format: its fenced blocks are its calls.

SmolLM2-135M-Instruct's chat template has no tool format, and the model writes none: with the tools listed
(and with a worked example) none of 64 samples held a <tool_call>, so the framework's tool-call parser would
find nothing to learn from. It does write ```python blocks, so this app's parse_action maps them onto the
server's tools: a ```python block calls submit (graded on the hidden tests, the episode ends), a ```run block
calls run_python (its output is the next turn, as a `tool` message). Everything else is the tool form's:
the tools listed to the policy, each call a call_tool step, the reward the server's (the fraction of hidden
tests passed). A model with a tool format uses tools_task.py, the same server, unchanged.
"""

from __future__ import annotations

from typing import Any

from apps.coder.task import _BLOCK  # the fenced blocks task.py reads: ```python and ```run
from apps.coder.tools_task import eval_metrics
from forge_rl.core.app import observation_fields

MCP_TOOLS = True
__all__ = ["MCP_TOOLS", "render_prompt", "parse_action", "eval_metrics"]


def render_prompt(observation: Any) -> str:
    obs = observation_fields(observation)
    how = "Answer with the complete function in one ```python block: that is your submission, graded on hidden tests."
    if obs["max_turns"] > 1:
        how += f" Before submitting you may run code (a ```run block) and read its output; you have {obs['max_turns']} turns."
    return f"{obs['statement']} {how}"


def parse_action(text: str, observation: Any = None) -> dict | None:
    """The answer's last fenced block as a tool call (```python: submit, ```run: run_python); None without one."""
    blocks = _BLOCK.findall(text)
    if not blocks or not blocks[-1][1].strip():
        return None
    kind, code = blocks[-1]
    return {"type": "call_tool", "tool_name": "submit" if kind == "python" else "run_python", "arguments": {"code": code}}
