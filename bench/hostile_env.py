"""The BlackJack server with a hung reward on demand, for bench/faults.py: armed (bench/armed.py,
`hung_reward`), the next step that ends a hand, the one that scores it, answers only after HANG_S, longer than
the run's env.timeout_s: the client must end that episode and never send the step again."""

from __future__ import annotations

import time

from apps.blackjack.env import BlackJackEnvironment
from bench.armed import take

HANG_S = 90.0  # then the step answers, to a client long gone, and the session is freed


class HostileBlackJack(BlackJackEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        observation = super().step(action, timeout_s, **kwargs)
        if observation.done and take("hung_reward"):
            time.sleep(HANG_S)
        return observation
