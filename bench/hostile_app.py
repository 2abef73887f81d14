"""apps/blackjack/task.py with bad input on demand, for bench/faults.py: each fault armed (bench/armed.py) is
taken once, by the first call it concerns.

    nan_reward, inf_reward, raise_reward  the next reward is NaN, +inf, or raises
    overflow                              the next prompt after a first decision outgrows generator.max_model_len
    parser                                the next answer reaches the tool-call parser behind text that crashed it
    hung_reward                           (the server's, bench/hostile_env.py) the next hand's end hangs its step
"""

from __future__ import annotations

import math

from apps.blackjack.task import ACTIONS, REFERENCE_POLICIES, SAMPLE_OBSERVATION, eval_metrics  # noqa: F401
from apps.blackjack import task
from bench.armed import take

HOSTILE_TEXT = "<tool_call>" + "[" * 100_000 + "</tool_call>"


def render_prompt(observation) -> str:
    prompt = task.render_prompt(observation)
    return prompt + " HIT" * 1000 if observation.get("step") and take("overflow") else prompt


def parse_action(text: str, observation=None):
    if take("parser"):
        from forge_rl.rollout.tools import parse_tool_call

        parse_tool_call(HOSTILE_TEXT + text)  # what a policy free to write anything could send
    return task.parse_action(text, observation)


def reward(observation, invalid: bool, invalid_penalty: float) -> float:
    if take("raise_reward"):
        raise ArithmeticError("a hostile reward function")
    if take("nan_reward"):
        return math.nan
    if take("inf_reward"):
        return math.inf
    return task.reward(observation, invalid, invalid_penalty)
