"""Evaluation: greedy play on fixed seeds with the current weights, read against the app's reference
policies on the same seeds, and the figures the console and the metrics show."""

from __future__ import annotations

import asyncio
import logging

from forge_rl.rollout.requests import GreedyAnswers
from forge_rl.rollout.rollouts import Rollouts, gather_or_cancel

logger = logging.getLogger(__name__)
REFERENCE_PREFIX = "eval/reference/"


def figures(values: dict) -> str:
    """'ev=-0.052 win=0.431 ...': a dict of metrics as the console shows them."""
    return " ".join(f"{k.removeprefix(REFERENCE_PREFIX).removeprefix('eval/')}={v:.3f}" for k, v in values.items())


class Evaluation:
    """The run's evaluation: seeds eval.seed ... eval.seed + num_games - 1 with eval.reset_args over
    env.reset_args; with eval.task_split, game i also resets on task i of that split (at most all of its
    tasks). `references` holds the reference policies' mean rewards on those games (played once),
    `last` the figures of the last evaluation (the progress bar's headline), `samples` a few of its games
    as text (the first seeds': the same deals at every evaluation)."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts
        cfg = rollouts.cfg
        self.seeds = range(cfg.eval.seed, cfg.eval.seed + cfg.eval.num_games)
        self.reset_args = {**cfg.env.reset_args, **cfg.eval.reset_args}
        self.references: dict[str, float] = {}  # "eval/reference/<name>" -> its mean reward on the seeds
        self.last: dict[str, float] = {}
        self.samples: list[dict] = []

    def games(self) -> list[tuple[int, dict]]:
        """(seed, reset arguments) of each evaluation game."""
        split = self.rollouts.cfg.eval.task_split
        if split is None:
            return [(seed, self.reset_args) for seed in self.seeds]
        n = min(len(self.seeds), self.rollouts.num_tasks[split])
        return [(seed, {**self.reset_args, "split": split, "index": i}) for i, seed in zip(range(n), self.seeds)]

    async def play_references(self) -> dict[str, float]:
        """The app's REFERENCE_POLICIES on the evaluation seeds: what the model's figures are read against,
        free of the seeds' luck. Played once per run."""
        for name, policy in self.rollouts.app.reference_policies.items():
            returns = await asyncio.gather(*(self._play_reference(policy, s, args) for s, args in self.games()))
            returns = [r for r in returns if r is not None]
            if returns:
                self.references[REFERENCE_PREFIX + name] = sum(returns) / len(returns)
        return self.references

    async def _play_reference(self, policy, seed: int, reset_args: dict) -> float | None:
        """One game of a reference policy (observation -> answer text, or None where it has no answer) on
        its own session: its reward, None if it had no answer."""
        app = self.rollouts.app
        async with self.rollouts.sessions.session() as session:
            observation = (await session.reset(seed=seed, **reset_args)).observation
            while not observation["done"]:
                answer = policy(observation)
                if answer is None:
                    return None
                observation = (await session.step(app.parse_action(answer, observation))).observation
        return app.reward(observation, False, 0.0)

    async def __call__(self) -> dict[str, float]:
        """Greedy play on the seeds with the current weights: the app's eval_metrics, its headline first."""
        greedy = GreedyAnswers(self.rollouts.generate, self.rollouts.sampling(greedy=True))
        results = await gather_or_cancel(self.rollouts.play(s, f"eval{s}", greedy, args) for s, args in self.games())
        done = [r for r in results if not r.aborted]
        self.samples = self.rollouts.samples(done)
        if not done:
            logger.warning("evaluation: all %d games were aborted; no evaluation", len(results))
            self.last = {"eval/games": 0}
        else:
            references = {k.removeprefix(REFERENCE_PREFIX): v for k, v in self.references.items()}
            self.last = self.rollouts.app.eval_metrics(done, references)
        return self.last
