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


# The form of a call, with placeholders where the program goes: a model shown a worked program may run that one
# instead of its own, and one shown no form may put the task's function where the tool's name belongs (coder.md).
CALL_FORM = '<tool_call>\n{"name": <the tool>, "arguments": {"code": <your program>}}\n</tool_call>'


def render_prompt(observation: Any) -> str:
    """The task of the reset: its statement, how to finish, and the form of a call."""
    obs = observation_fields(observation)
    return (f"{obs['statement']}\n\nTest your code with run_python (define the function and print a few of its results), "
            f"then call submit with the program defining `{obs['entry_point']}`. You have {obs['max_turns']} tool calls. "
            f"Each answer is one tool call:\n{CALL_FORM}")  # fmt: skip


TOOLS = ("run_python", "submit")  # what tools_env.py lists


def eval_metrics(results: list, references: dict) -> dict[str, float]:
    """pass@1 (greedy): the share of tasks whose submission passed every hidden test; the mean reward; the share of
    answers that call a listed tool (`call_rate`), and of episodes that ran code before their submission."""
    n = max(len(results), 1)
    actions = [action for r in results for _, _, action in r.turns]
    called = [[a["tool_name"] for _, _, a in r.turns if a] for r in results]
    return {"eval/pass_at_1": sum(r.reward == 1.0 for r in results) / n, "eval/reward": sum(r.reward for r in results) / n,
            "eval/call_rate": sum(bool(a) and a["tool_name"] in TOOLS for a in actions) / max(len(actions), 1),
            "eval/ran_before_submit": sum("run_python" in c and c[-1:] == ["submit"] for c in called) / n}  # fmt: skip
