"""A reward is a finite number or an error: the one check of every path that brings a reward (an environment's
reply, the dataset server's reward function, the chat server, an app's or an agent's reward). Standard library
only: the environment servers' virtualenv imports it too."""

from __future__ import annotations

import math
import numbers

REASONS = ("reward_not_finite", "reward_not_a_number", "reward_raised", "reward_timeout")


class RewardError(ValueError):
    """No usable reward: an error of its episode, which costs the episode's group (counted as
    rollout/lost_groups/<reason>), never the run or the weights. The message starts with the reason, one of
    REASONS: a server's refusal names it so over the wire (rollout/env_client.py)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def checked_reward(value, source: str) -> float:
    """`value` as a float when it is a finite real number; else RewardError naming `source`. A bool is refused:
    it is a number to Python, but a reward function returning one has a bug more often than a meaning."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RewardError("reward_not_a_number", f"{source} gave {type(value).__name__} {str(value)[:80]!r}")
    if not math.isfinite(value):
        raise RewardError("reward_not_finite", f"{source} gave {value!r}")
    return float(value)
