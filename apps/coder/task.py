"""Code tasks as a training app (env.py): what the policy reads, how its answer
becomes an action, what it earns, and how an evaluation is summarised.

Three task sets, one module: `synth` (f(x) from three examples; the answer is an expression in x, always
submitted), `functions` (a function described in plain English) and `humaneval` (a function from its
docstring). For the last two, with `max_turns` > 1 the policy may first run code in a ```run block and read
the output, and submits a ```python block; whatever it answers on its last turn is the submission.
Observations are the dicts the client returns; nothing here imports the server.

Constrained decoding (sampling.constrained, synth only): the policy samples up to sampling.max_tokens
tokens of ANSWER_VOCABULARY, so "x*7" is three tokens; a uniformly random three-token answer passes
every hidden test about 0.1% of the time.
"""

from __future__ import annotations

import re
from typing import Any

from forge_rl.core.app import observation_fields as _fields
from forge_rl.core.app import terminal_reward

ANSWER_VOCABULARY = ("x", "+", "-", "*", *"0123456789")  # each one token of the tiny model's tokenizer
# A synth task as the client returns it: the config check renders its prompt against the tiny model's words.
SAMPLE_OBSERVATION = {"task_set": "synth", "examples": [[1, -4], [8, 3], [13, 8]], "turn": 0, "max_turns": 1}

_BLOCK = re.compile(r"```(python|run)[^\n]*\n(.*?)```", re.DOTALL)


def render_prompt(observation: Any) -> str:
    """synth: "f(1) = -4, f(8) = 3, f(13) = 8. f(x) =" (every word a token of the tiny model).
    humaneval: the task on the first turn; on later turns the output of the last run."""
    obs = _fields(observation)
    turns_left = obs["max_turns"] - obs["turn"]
    if obs["task_set"] == "synth":
        return ", ".join(f"f({x}) = {y}" for x, y in obs["examples"]) + ". f(x) ="
    if obs["turn"] == 0:
        how = "Answer with the complete function in one ```python block: that is your submission, graded on hidden tests."
        if turns_left > 1:
            how += f" Before submitting you may run code (a ```run block) and read its output; you have {turns_left} turns."
        if obs["task_set"] == "functions":
            return f"{obs['statement']} {how}"
        return f"Complete this Python function.\n\n```python\n{obs['statement']}```\n\n{how}"
    status = "timed out" if obs.get("timed_out") else f"exit code {obs.get('exit_code')}"
    last = " This is your last turn: submit a ```python block." if turns_left == 1 else f" {turns_left} turns left."
    return f"Your run ({status}):\nstdout:\n{obs.get('stdout', '')[-2000:]}\nstderr:\n{obs.get('stderr', '')[-2000:]}\n{last.strip()}"


def parse_action(text: str, observation: Any = None) -> dict | None:
    """synth: the expression, submitted. humaneval: the last fenced block, a ```python block submitted and
    a ```run block run; without a block the whole answer is run (its error is the feedback). On the last
    turn whatever is answered is the submission. Empty -> None (invalid)."""
    obs = _fields(observation) if observation is not None else {"task_set": "synth"}
    if obs.get("task_set", "synth") == "synth":
        code = text.strip()
        return {"code": code, "submit": True} if code else None
    blocks = _BLOCK.findall(text)
    kind, code = blocks[-1] if blocks else ("run", text)
    if not code.strip():
        return None
    last_turn = obs.get("turn", 0) + 1 >= obs.get("max_turns", 1)
    return {"code": code, "submit": kind == "python" or last_turn}


def reward(observation: Any, invalid: bool, invalid_penalty: float) -> float:
    """The fraction of hidden tests passed once submitted (0 for an episode out of turns); -penalty if invalid."""
    return terminal_reward(observation, invalid, invalid_penalty)


UNGRADABLE = ("syntax_error", "no_function")  # the server's verdicts on a submission that is not a function to test


def eval_metrics(results: list, references: dict[str, float]) -> dict[str, float]:
    """eval/pass_at_1: share of tasks whose (greedy) submission passed every hidden test; eval/pass_rate: mean
    fraction of tests passed; eval/invalid_rate: answers with no code, code that does not parse, or code that
    defines no function of the asked name. `results`: the evaluation's games (reward, invalid, observation)."""
    n = max(len(results), 1)
    passed = [0.0 if r.invalid else max(r.reward, 0.0) for r in results]
    ungradable = [r.invalid or (r.observation or {}).get("verdict") in UNGRADABLE for r in results]
    return {
        "eval/pass_at_1": sum(p == 1.0 for p in passed) / n,
        "eval/pass_rate": sum(passed) / n,
        "eval/invalid_rate": sum(ungradable) / n,
        "eval/tasks": len(results),
    }


# The enumerative synthesizer: the reference policy of the synth families.


def family_programs(family: int) -> list[str]:
    """Every program of a synth family, in the order the synthesizer tries them."""
    if family == 1:
        return [f"x{op}{d}" for op in "+-*" for d in range(10)]
    return [f"x*{a}+{b}" for a in range(10) for b in range(10)]


def synthesize(examples: list, family: int = 1) -> str | None:
    """The first program of the family consistent with the shown examples (None if none is)."""
    for expression in family_programs(family):
        if all(eval(expression, {"x": x}) == y for x, y in examples):  # our own expressions
            return expression
    return None


def synthesizer(observation: Any) -> str | None:
    """Reference policy: the synthesizer's answer for a synth task; None (no reference) for other task sets."""
    obs = _fields(observation)
    if obs["task_set"] != "synth":
        return None
    return synthesize(obs["examples"], int(obs["task_id"].split("/")[0].removeprefix("synth")))


REFERENCE_POLICIES = {"synthesizer": synthesizer}
