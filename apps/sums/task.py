"""One-digit sums ("What is 3 + 4?") as a task from a dataset: the rows are sums.jsonl's (make_data.py), the
server is forge_rl's dataset server (env.dataset), and this module is all the task's own code. It is imported
by the run and by the dataset server (which calls `reward`), so it imports nothing beyond the standard library.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def render_prompt(observation: Any) -> str:
    """The row's prompt as it is: SmolLM2's own system prompt already makes it answer "3 + 4 = 7" to some."""
    return observation["prompt"]


def parse_action(text: str, observation: Any = None) -> dict[str, str] | None:
    """The answer is the last number the text names ("3 + 4 = 7." -> "7"); None (invalid) if it names none."""
    numbers = _NUMBER.findall(text)
    return {"answer": numbers[-1]} if numbers else None


def reward(prompt_row: dict, answer: str) -> float:
    """1 for the sum, 0 for anything else: called by the dataset server with the row (its "answer" is never shown
    to the policy) and the answer parse_action made."""
    return 1.0 if answer == str(prompt_row["answer"]) else 0.0


def eval_metrics(results, references) -> dict:
    """What an evaluation reports: the share of held-out sums answered right (greedy), and of answers with no number."""
    n = max(len(results), 1)
    return {"eval/accuracy": sum(r.reward > 0 for r in results) / n, "eval/invalid": sum(r.invalid for r in results) / n}
