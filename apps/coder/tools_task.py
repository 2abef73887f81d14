"""The code tools environment (tools_env.py) as a training app: the policy writes a function by calling the
server's tools, `run_python(code)` to try code and `submit(code)` to be graded on the hidden tests.

The tool-calling itself is the framework's (forge_rl/rollout/tools.py): the tools as the server lists them,
rendered with the model's chat template; the answer's tool call parsed into a call_tool step; the tool's
result as the next turn; the reward the server's once submit ends the episode. This app gives only the task.
"""

from __future__ import annotations

from typing import Any

from forge_rl.core.app import observation_fields

MCP_TOOLS = True
SYSTEM_PROMPT = "You write Python functions. Act only by calling the tools."


def render_prompt(observation: Any) -> str:
    """The task of the reset: its statement, and how to finish."""
    obs = observation_fields(observation)
    return (f"{obs['statement']} You may test code with run_python; when it is right, call submit with the "
            f"program defining `{obs['entry_point']}`. You have {obs['max_turns']} tool calls.")  # fmt: skip


def eval_metrics(results: list, references: dict) -> dict[str, float]:
    """pass@1 (greedy): the share of tasks whose submission passed every hidden test; then the mean reward."""
    n = max(len(results), 1)
    return {"eval/pass_at_1": sum(r.reward == 1.0 for r in results) / n, "eval/reward": sum(r.reward for r in results) / n}
