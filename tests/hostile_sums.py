"""apps/sums with a hostile reward function, for the SmolLM2 run of issue #53 (configs/sums_smollm2_cpu.yaml with
app_module=tests.hostile_sums): for 1 in 10 (row, answer) pairs, fixed by a hash, the reward is NaN, +inf,
an exception or no answer at all; every other answer is scored as apps.sums scores it."""

import hashlib
import math
import time

from apps.sums.task import eval_metrics, parse_action, render_prompt  # noqa: F401
from apps.sums.task import reward as sums_reward


def reward(prompt_row: dict, answer: str) -> float:
    kind = int(hashlib.sha256(f"{prompt_row['prompt']}|{answer}".encode()).hexdigest(), 16) % 40
    if kind == 0:
        return math.nan
    if kind == 1:
        return math.inf
    if kind == 2:
        raise ValueError("a hostile reward function")
    if kind == 3:
        time.sleep(3600)
    return sums_reward(prompt_row, answer)
