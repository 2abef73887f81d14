"""Evaluation: greedy play on fixed seeds with the current weights, read against the app's reference
policies on the same seeds, and the figures the console and the metrics show; with eval.samples, pass@k
of games sampled at the training temperature on the same seeds and tasks."""

from __future__ import annotations

import asyncio
import logging
import math

from forge_rl.core.rewards import checked_reward
from forge_rl.rollout.requests import GreedyAnswers, SharedRequests
from forge_rl.rollout.rollouts import Rollouts, gather_or_cancel

logger = logging.getLogger(__name__)
REFERENCE_PREFIX = "eval/reference/"


def figures(values: dict) -> str:
    """'ev=-0.052 win=0.431 ...': a dict of metrics as the console shows them."""
    return " ".join(f"{k.removeprefix(REFERENCE_PREFIX).removeprefix('eval/')}={v:.3f}" for k, v in values.items())


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021) from n samples of one task, c of which pass:
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold one that passes;
    computed as 1 - prod_{i = n-c+1 .. n} (1 - k / i), free of huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Evaluation:
    """Seeds eval.seed ... eval.seed + num_games - 1; with eval.task_split, game i plays task i of each split
    (the first's figures are eval/..., the others' eval/<split>/...). With eval.samples n, each game is also
    played n times at the training sampling: eval/sampled_pass_at_<k>, passing at eval.pass_reward or more.
    `last`: the last evaluation's figures, its first two the progress bar's headline."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts
        cfg = rollouts.cfg
        self.seeds = range(cfg.eval.seed, cfg.eval.seed + cfg.eval.num_games)
        self.reset_args = {**cfg.env.reset_args, **cfg.eval.reset_args}
        self.splits = cfg.eval.splits  # [None] without eval.task_split
        self.references: dict[str, float] = {}  # "eval/reference/<name>" (eval/<split>/reference/...) -> mean reward
        self.split_references: list[dict[str, float]] = [{} for _ in self.splits]  # per split: name -> mean reward
        self.last: dict[str, float] = {}
        self.samples: list[dict] = []  # a few greedy games as text: the first split's first seeds, the same deals each time
        self.sampled_rewards: dict[str | None, list[list[float]]] = {}  # split -> per game, its sampled games' rewards

    def games(self, i: int = 0) -> list[tuple[int, dict]]:
        """(seed, reset arguments) of each evaluation game of the i-th split of eval.task_split."""
        split = self.splits[i]
        if split is None:
            return [(seed, self.reset_args) for seed in self.seeds]
        n = min(len(self.seeds), self.rollouts.num_tasks[split])
        return [(seed, {**self.reset_args, "split": split, "index": index}) for index, seed in zip(range(n), self.seeds)]

    def named(self, i: int, values: dict) -> dict:
        """The i-th split's figures as logged: the first's as they are, every other's eval/<split>/..."""
        if i == 0:
            return values
        return {f"eval/{self.splits[i]}/{k.removeprefix('eval/')}": v for k, v in values.items()}

    async def play_references(self) -> dict[str, float]:
        """What the model's figures are read against, free of the seeds' luck. Played once per run."""
        for i in range(len(self.splits)):
            for name, policy in self.rollouts.app.reference_policies.items():
                returns = await asyncio.gather(*(self._play_reference(policy, s, args) for s, args in self.games(i)))
                returns = [r for r in returns if r is not None]
                if returns:
                    self.split_references[i][name] = sum(returns) / len(returns)
            self.references.update(self.named(i, {REFERENCE_PREFIX + k: v for k, v in self.split_references[i].items()}))
        return self.references

    async def _play_reference(self, policy, seed: int, reset_args: dict) -> float | None:
        """Its reward, None if the policy had no answer or the game was lost."""
        app = self.rollouts.app
        try:
            async with self.rollouts.sessions.session() as session:
                observation = (await session.reset(seed=seed, **reset_args)).observation
                while not observation["done"]:
                    answer = policy(observation)
                    if answer is None:
                        return None
                    observation = (await session.step(app.parse_action(answer, observation))).observation
            return checked_reward(app.reward(observation, False, 0.0), f"{app.name}.reward")
        except Exception as e:
            self.rollouts.lost(e)
            return None

    async def __call__(self) -> dict[str, float]:

        values = {}
        for i in range(len(self.splits)):
            values.update(self.named(i, await self._evaluate(i)))
        self.last = values
        return self.last

    async def _evaluate(self, i: int) -> dict[str, float]:
        """The i-th split's figures, named as the first split's: its greedy and sampled games, played at once."""
        rollouts, games, n = self.rollouts, self.games(i), self.rollouts.cfg.eval.samples
        greedy = GreedyAnswers(rollouts.generate, rollouts.sampling(greedy=True))
        plays = [rollouts.play(s, f"eval{s}", greedy, args) for s, args in games]
        sampled = [self._sampled(i, s, args) for s, args in games] if n else []
        results = await gather_or_cancel(plays + sampled)
        done = [r for r in results[: len(games)] if not r.lost]
        if i == 0:
            self.samples = rollouts.samples(done)
        if not done:
            logger.warning("evaluation of %s: all %d games were lost; no evaluation", self.splits[i] or "the seeds", len(games))
            values = {"eval/games": 0}
        else:
            values = rollouts.app.eval_metrics(done, self.split_references[i])
        if n:
            rewards = self.sampled_rewards[self.splits[i]] = [[r.reward for r in task if not r.lost] for task in results[len(games) :]]
            values.update(pass_figures(rewards, rollouts.cfg.eval.ks, rollouts.cfg.eval.pass_reward))
        return values

    async def _sampled(self, i: int, seed: int, reset_args: dict) -> list:
        """Seeded from the run's seed, the split and the game's seed: the same samples for the same weights."""
        rollouts, n = self.rollouts, self.rollouts.cfg.eval.samples
        shared = SharedRequests(rollouts.generate, n, rollouts.sampling(), seed=(rollouts.cfg.seed, "eval", self.splits[i], seed))
        return await gather_or_cancel(rollouts.play(seed, f"eval{seed}sampled", shared, reset_args) for _ in range(n))


def pass_figures(rewards: list[list[float]], ks: list[int], pass_reward: float) -> dict[str, float]:
    """A game with fewer than k samples left (others lost) is left out; a k no game has enough for is not reported."""
    counts = [(len(task), sum(r >= pass_reward for r in task)) for task in rewards]
    values = {}
    for k in ks:
        scored = [pass_at_k(n, c, k) for n, c in counts if n >= k]
        if scored:
            values[f"eval/sampled_pass_at_{k}"] = sum(scored) / len(scored)
    return values
