"""Rollouts: a run's game playing against the policy service, and what it counts.

    rollouts.group(seed) -> G episodes dealt from one seed (None when one of them was lost)

It owns the environment sessions, the batcher that sends the games' requests to the policy together,
the chat server of agent apps, and its counters (games played and aborted, groups dropped for a game
without an episode, the recent rewards the progress bar shows). The policy is any object with `route(endpoint, ...)` (a Service of Generators).
"""

from __future__ import annotations

import asyncio
import logging
import random

from forge_rl.core.app import App
from forge_rl.core.config import RunConfig
from forge_rl.core.types import Completion, Episode
from forge_rl.rollout.agents import play_agent, stop_chat_server
from forge_rl.rollout.batching import RequestBatcher
from forge_rl.rollout.play import GameResult, play_game, sampling_params
from forge_rl.rollout.requests import SharedRequests
from forge_rl.rollout.sessions import SessionPool

SAMPLES_PER_EVENT = 3  # games logged as text each time samples are (samples.jsonl)
GROUPS_LOST_BEFORE_GIVING_UP = 20  # groups in a row lost (every game aborted, or a game without an episode)
logger = logging.getLogger(__name__)


async def gather_or_cancel(coroutines) -> list:
    """asyncio.gather, except that once one raises, the others are cancelled and waited for before its error
    propagates: the sibling games of a lost group must not play on, holding sessions and engine load."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class GroupsLost(RuntimeError):
    """Every one of many groups in a row gave nothing to train on: the run stops (the next would too)."""


class EnvironmentLost(GroupsLost):
    """No game can be played any more (the environment server stopped answering): the run stops."""


class Rollouts:
    """Lifecycle: constructed once the policy service is up; `group` and `play` any number of times,
    concurrently; `close` at the end (sessions, the chat server)."""

    def __init__(self, cfg: RunConfig, app: App, tokenizer, policy, env_url: str, allowed_token_ids: list[int] | None):
        self.cfg, self.app, self.tokenizer, self.policy = cfg, app, tokenizer, policy
        self.allowed_token_ids = allowed_token_ids  # constrained decoding: the only ids the policy may sample
        self.answer_length = cfg.sampling.max_tokens if app.multi_token_answers else 1  # tokens per answer
        self.sessions = SessionPool(env_url, cfg.env.max_concurrent, cfg.env.timeout_s, cfg.env.capacity_wait_s)
        self.num_tasks: dict[str, int] = {}  # split -> its tasks, asked of the server at start (env/eval.task_split)
        self.batcher: RequestBatcher | None = None  # made on the first request (it needs the running loop)
        self.agents = None  # agent apps: the task starting the chat server (rollout/agents.py)
        self.episodes_played = 0
        self.aborted_games = 0
        self.groups_without_episodes = 0  # dropped: a game ended, not aborted, with nothing to train on
        self.env_s = self.policy_s = 0.0  # seconds games waited on environments / on the policy, summed over games
        self.groups_lost_in_a_row = 0  # groups aborted whole or dropped, since the last one that was neither
        self.last_abort = ""  # why the last aborted game was
        self.recent: list[tuple[float, bool]] = []  # (reward, invalid) of recent training games
        self.last_group: list[GameResult] = []  # the games of the group that ended last (samples)

    def sampling(self, greedy: bool = False) -> dict:
        return sampling_params(self.cfg.sampling, self.allowed_token_ids, greedy, self.answer_length)

    async def generate(self, prompt_ids: list[int], params: dict) -> list[Completion]:
        """One request to the policy service, sent with those of the other games in flight in one call
        to whichever generator replica it routes to."""
        if self.batcher is None:
            send = lambda requests: self.policy.route("generate_batch", requests)  # noqa: E731
            self.batcher = RequestBatcher(send, max_in_flight=len(self.policy.replicas))
        return await self.batcher.generate(prompt_ids, params)

    async def play(self, seed: int, group_id: str, asks, reset_args: dict | None = None) -> GameResult:
        """One game, or one agent run for an agent app (same arguments, same result)."""
        if self.app.is_agent:
            return await play_agent(self, seed, group_id, asks, reset_args)
        return await play_game(self, seed, group_id, asks, reset_args)

    def task_reset_args(self, seed: int) -> dict | None:
        """With env.task_split, the group's task: the split and an index drawn from the run's and the group's
        seeds (the same task on a resumed run), over env.reset_args; None without a split (seeds alone)."""
        split = self.cfg.env.task_split
        if split is None:
            return None
        index = random.Random(f"{self.cfg.seed}:{seed}").randrange(self.num_tasks[split])
        return {**self.cfg.env.reset_args, "split": split, "index": index}

    async def group(self, seed: int) -> list[Episode] | None:
        """G games dealt from one seed (on one task with env.task_split): the group GRPO compares (same
        cards, different decisions)."""
        size, reset_args = self.cfg.grpo.group_size, self.task_reset_args(seed)
        shared = SharedRequests(self.generate, size, self.sampling(), seed=(self.cfg.seed, seed))
        results = await gather_or_cancel(self.play(seed, f"seed{seed}", shared, reset_args) for _ in range(size))
        self.episodes_played += len(results)
        self.last_group = results
        self.aborted_games += sum(r.aborted for r in results)
        self.env_s += sum(r.env_s for r in results)
        self.policy_s += sum(r.policy_s for r in results)
        # A game that ended without asking the policy (an agent that never called the model, a game done at
        # reset) has no episode: its group is not comparable, so it is dropped, and said so.
        empty = sum(not r.aborted and not r.episodes for r in results)
        if empty:
            self.groups_without_episodes += 1
            logger.warning("group on seed %d dropped: %d of its games ended without asking the policy", seed, empty)
        lost = empty or all(r.aborted for r in results)
        self.groups_lost_in_a_row = self.groups_lost_in_a_row + 1 if lost else 0
        if self.groups_lost_in_a_row >= GROUPS_LOST_BEFORE_GIVING_UP and empty:
            raise GroupsLost(
                f"the last {self.groups_lost_in_a_row} groups were dropped, the last for {empty} games that ended "
                "without asking the policy: an agent must call the model (ctx.base_url), a game must reach a decision"
            )
        if self.groups_lost_in_a_row >= GROUPS_LOST_BEFORE_GIVING_UP:
            raise EnvironmentLost(
                f"every game of the last {self.groups_lost_in_a_row} groups was aborted (last: {self.last_abort}): "
                "the environment server is gone; check env.url / env.server"
            )
        self.recent = (self.recent + [(r.reward, r.invalid) for r in results if not r.aborted])[-2000:]
        episodes = [e for r in results for e in r.episodes]
        return episodes if all(r.episodes for r in results) else None  # a group with a dropped game is not comparable

    def samples(self, results: list[GameResult]) -> list[dict]:
        """The first SAMPLES_PER_EVENT games of `results` to read: each turn's prompt as the policy read it
        (chat template included) and its answer, decoded, the action parse_action made of it, the reward."""
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
