"""Reasoning-gym tasks (apps/reasoning/env.py) as a training task for a chat model answering in free text.

The prompt is the generator's question as it is. The answer sent to the server is what reasoning-gym's
verifiers compare with their answer: the text inside <answer>...</answer> if the model wrote the tags (the
format reasoning-gym's own prompts ask for), else the last number the text names (the numeric families:
chain_sum, basic_arithmetic, leg_counting, ...). The reward is the server's, from the family's verifier.
"""

from __future__ import annotations

import re
from typing import Any

from forge_rl.core.app import observation_fields, terminal_reward

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SAMPLE_OBSERVATION = {"family": "chain_sum", "question": "State the final answer to the following arithmetic problem: 4 - 1 =",
                      "error": None, "done": False, "reward": None}  # fmt: skip


def render_prompt(observation: Any) -> str:
    """The question as the generator wrote it (SmolLM2's default system prompt stays)."""
    return observation_fields(observation)["question"]


def parse_action(text: str, observation: Any = None) -> dict[str, str] | None:
    """'4 - 1 = 3.' -> {"answer": "3"}; '<answer>3</answer>' -> {"answer": "3"}; None (invalid) if the text
    has neither tags nor a number. Thousands commas are dropped ("1,024" is 1024): the verifiers drop them too."""
    tagged = _TAGGED.findall(text)
    if tagged and tagged[-1].strip():
        return {"answer": tagged[-1].strip()}
    numbers = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return {"answer": numbers[-1]} if numbers else None


def reward(observation: Any, invalid: bool, invalid_penalty: float) -> float:
    """The verifier's score the server sent with the final observation; -invalid_penalty for no answer."""
    return terminal_reward(observation, invalid, invalid_penalty)


def eval_metrics(results, references) -> dict:
    """The share of held-out tasks answered right (the verifier's full score, greedy), the mean score (with the
    partial credit some verifiers give), and the share of answers with nothing to send."""
    n = max(len(results), 1)
    return {
        "eval/accuracy": sum(r.reward >= 1.0 for r in results) / n,
        "eval/score": sum(r.reward for r in results) / n,
        "eval/invalid": sum(r.invalid for r in results) / n,
    }
