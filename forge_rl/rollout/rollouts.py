"""Rollouts: a run's game playing against the policy service, and what it counts.

    rollouts.group(seed) -> G episodes dealt from one seed (None when one of them was lost)

A game that raises costs its group, never the run: the group is dropped, its other games cancelled, and
counted by reason (an error's `reason`, else its type's name), said in run.log once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter

from forge_rl.core.app import App
from forge_rl.core.config import RunConfig
from forge_rl.core.errors import first_line
from forge_rl.core.types import Completion, Episode
from forge_rl.rollout.agents import play_agent, stop_chat_server
from forge_rl.rollout.batching import RequestBatcher
from forge_rl.rollout.play import GameResult, play_game, sampling_params
from forge_rl.rollout.requests import SharedRequests
from forge_rl.rollout.sessions import SessionPool

SAMPLES_PER_EVENT = 3  # games logged as text each time samples are (samples.jsonl)
GROUPS_LOST_BEFORE_GIVING_UP = 20  # groups lost in a row: the next would be too, something is broken
logger = logging.getLogger(__name__)


async def gather_or_cancel(coroutines) -> list:
    """Once one raises, the others are cancelled: a lost group's games must not play on, holding sessions."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class GroupsLost(RuntimeError):
    """Every one of many groups in a row gave nothing to train on (a gone environment server, a reward function
    that always fails): the run stops, the next would too."""


class NoEpisode(RuntimeError):
    """A game ended without asking the policy: nothing to train on, and its group is not comparable without it."""

    reason = "no_episode"


class Rollouts:


    def __init__(self, cfg: RunConfig, app: App, tokenizer, policy, env_url: str, allowed_token_ids: list[int] | None):
        self.cfg, self.app, self.tokenizer, self.policy = cfg, app, tokenizer, policy
        self.allowed_token_ids = allowed_token_ids  # constrained decoding: the only ids the policy may sample
        self.answer_length = cfg.sampling.max_tokens if app.multi_token_answers else 1  # tokens per answer
        self.sessions = SessionPool(env_url, cfg.env.max_concurrent, cfg.env.timeout_s, cfg.env.capacity_wait_s)
        self.num_tasks: dict[str, int] = {}  # split -> its tasks, asked of the server at start (env/eval.task_split)
        self.batcher: RequestBatcher | None = None  # made on the first request (it needs the running loop)
        self.agents = None  # agent apps: the task starting the chat server (rollout/agents.py)
        self.episodes_played = 0
        self.prompt_overflows = 0  # training games cut off for a prompt of generator.max_model_len tokens
        self.lost_groups: Counter[str] = Counter()  # reason -> training groups lost to it
        self.env_s = self.policy_s = 0.0  # seconds games waited on environments / on the policy, summed over games
        self.groups_lost_in_a_row = 0  # since the last group that was not lost
        self.last_abort = ""  # why the last game was lost, in a line
        self.reasons_said: set[str] = set()  # reasons a game was lost for, each said once in run.log
        self.recent: list[tuple[float, bool]] = []  # (reward, invalid) of recent training games
        self.last_group: list[GameResult] = []  # the games of the group that ended last (samples)

    def sampling(self, greedy: bool = False) -> dict:
        return sampling_params(self.cfg.sampling, self.allowed_token_ids, greedy, self.answer_length)

    async def generate(self, prompt_ids: list[int], params: dict) -> list[Completion]:
        """Batched with the other games' requests in flight into one call per replica."""
        if self.batcher is None:
            send = lambda requests: self.policy.route("generate_batch", requests)  # noqa: E731
            self.batcher = RequestBatcher(send, max_in_flight=len(self.policy.replicas))
        return await self.batcher.generate(prompt_ids, params)

    async def play(self, seed: int, group_id: str, asks, reset_args: dict | None = None) -> GameResult:
        """One game, or one agent run for an agent app; one that raised is a lost game."""
        try:
            return await self.game(seed, group_id, asks, reset_args)
        except Exception as e:
            return GameResult([], 0.0, False, lost=self.lost(e))

    async def game(self, seed: int, group_id: str, asks, reset_args: dict | None = None) -> GameResult:
        """`play`, raising the game's error (a group cancels its other games on it)."""
        if self.app.is_agent:
            return await play_agent(self, seed, group_id, asks, reset_args)
        return await play_game(self, seed, group_id, asks, reset_args)

    def lost(self, error: Exception) -> str:
        """Said in run.log the first time, with the traceback of an error no reason names."""
        reason, self.last_abort = getattr(error, "reason", type(error).__name__), first_line(error)
        if reason not in self.reasons_said:
            self.reasons_said.add(reason)
            logger.warning("a game was lost to %s (its group is dropped and counted as rollout/lost_groups/%s; said once): %s",
                           reason, reason, self.last_abort, exc_info=None if hasattr(error, "reason") else error)  # fmt: skip
        return reason

    def task_reset_args(self, seed: int) -> dict | None:
        """With env.task_split, an index drawn from the run's and the group's seeds: the same task on a resumed run."""
        split = self.cfg.env.task_split
        if split is None:
            return None
        index = random.Random(f"{self.cfg.seed}:{seed}").randrange(self.num_tasks[split])
        return {**self.cfg.env.reset_args, "split": split, "index": index}

    async def group(self, seed: int) -> list[Episode] | None:
        """G games dealt from one seed: the group GRPO compares (same cards, different decisions)."""
        size, reset_args = self.cfg.grpo.group_size, self.task_reset_args(seed)
        shared = SharedRequests(self.generate, size, self.sampling(), seed=(self.cfg.seed, seed))
        try:
            results = await gather_or_cancel(self.game(seed, f"seed{seed}", shared, reset_args) for _ in range(size))
        except Exception as e:  # its other games are cancelled: a group with a game missing is not comparable
            return self.lose_group(self.lost(e))
        self.episodes_played += len(results)
        self.last_group = results
        self.prompt_overflows += sum(r.overflowed for r in results)
        self.env_s += sum(r.env_s for r in results)
        self.policy_s += sum(r.policy_s for r in results)
        self.recent = (self.recent + [(r.reward, r.invalid) for r in results])[-2000:]
        if empty := sum(not r.episodes for r in results):
            hint = "an agent must call the model (ctx.base_url), a game must reach a decision"
            return self.lose_group(self.lost(NoEpisode(f"{empty} of a group's games ended without asking the policy: {hint}")))
        self.groups_lost_in_a_row = 0
        return [e for r in results for e in r.episodes]

    def lose_group(self, reason: str) -> None:
        """A group lost to `reason`, counted; GROUPS_LOST_BEFORE_GIVING_UP in a row stop the run."""
        self.lost_groups[reason] += 1
        self.groups_lost_in_a_row += 1
        if self.groups_lost_in_a_row >= GROUPS_LOST_BEFORE_GIVING_UP:
            hint = "; is the environment server gone? check env.url / env.server" if reason == "session_lost" else ""
            raise GroupsLost(f"the last {self.groups_lost_in_a_row} groups were lost, the last to {reason} ({self.last_abort}){hint}")

    def samples(self, results: list[GameResult]) -> list[dict]:
        """The first SAMPLES_PER_EVENT games as the policy read them (chat template included), decoded."""
        def turn(prompt, answer, action):
            return {"prompt": self.tokenizer.decode(prompt, skip_special_tokens=False), "answer": answer, "action": action}

        played = [r for r in results if r.turns][:SAMPLES_PER_EVENT]
        return [{"reward": r.reward, "invalid": r.invalid, "turns": [turn(*t) for t in r.turns]} for r in played]

    def recent_figures(self, n: int = 500) -> tuple[float, float]:
        """(mean reward, invalid rate) of the last `n` training games."""
        last = self.recent[-n:]
        return sum(r for r, _ in last) / max(len(last), 1), sum(i for _, i in last) / max(len(last), 1)

    async def close(self) -> None:
        if self.agents is not None:
            await stop_chat_server(self)
        await self.sessions.close()
