"""The GRPO loop every app shares: the whole training job in one file.

    python -m forge_rl.grpo --config configs/blackjack_tiny_cpu.yaml [dotted.key=value ...]

An app is only its task module (the config's `app_module`, e.g. apps/blackjack/game.py); this file
knows no app. Dataflow (each box a Monarch actor mesh or service, the loops asyncio tasks on this controller):

    environment ◀──action── rollout workers ──prompt ids──▶ policy service (vLLM Generators)
     (OpenEnv)  ──obs────▶  (G games per seed)   ◀─completions (ids, log-probs, version)─┘
                                       │ one group = G games dealt from the same seed
                                       ▼
                                 replay buffer ──batch──▶ training loop ──train_step──▶ Trainer (TorchTitan)
                                  (drops data older than       │ (reference log-probs      │ push_weights(v)
                                   max_policy_age)             │  when kl_coef > 0)        ▼
                                                               └─update_weights(v)◀── TorchStore

- Rollout workers (`rollout_worker`) consume a seed, play G games on it concurrently, and put the
  group in the replay buffer. They never wait for training; the buffer drops what grows too stale.
- The training loop (`train`) waits only for the buffer to hold a batch, trains one step, pushes the
  weights as version v+1, and has every generator load them before the next step.
- `synchronous: true` instead alternates: collect a batch with the current weights, then train.

One game is one episode; its turns are one token sequence (forge_rl.rollout.Conversation): what the
policy sampled is kept as sampled, each new observation is tokenized alone and appended. The prompt,
the parsing of the answer and the reward are the three functions of the config's `app_module`
(apps/blackjack/game.py); nothing below knows the rules of any game, so another OpenEnv environment
trains with this file unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge_rl import faults, store, weight_sync
from forge_rl.actor import call, start_all, stop
from forge_rl.batching import RequestBatcher
from forge_rl.config import ConfigError, RunConfig, dump, parse_cli
from forge_rl.envs import load_env_class
from forge_rl.envs.client import EnvSession, EpisodeAborted, env_url
from forge_rl.generator import Generator
from forge_rl.metrics import MetricsLogger, plot_curves
from forge_rl.provisioner import get_provisioner
from forge_rl.reference import ReferenceModel
from forge_rl.replay_buffer import ReplayBufferActor
from forge_rl.rollout import Conversation
from forge_rl.trainer import Trainer
from forge_rl.types import Completion, Episode

logger = logging.getLogger("forge_rl.grpo")
BUFFER_TIMEOUT_S = 60.0  # per call to the replay buffer actor (every endpoint returns at once)
EXIT_GRACE_S = 60.0  # the longest the interpreter may take to exit after the run has stopped
STALL_WARNING_S = 60.0  # a training loop without a step for this long says what it waits for


# ---------------------------------------------------------------------------------------------------
# One game


class SessionPool:
    """At most `size` environment sessions, each kept open and reused for one game after another
    (a WebSocket connection per game would cost more than the game). A session that raised out of a
    game is closed, not reused."""

    def __init__(self, url: str, size: int, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.free: asyncio.Queue = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(None)  # a slot without a session yet

    @contextlib.asynccontextmanager
    async def session(self):
        session = await self.free.get() or EnvSession(self.url, timeout_s=self.timeout_s)
        try:
            yield session
        except BaseException:
            broken, session = session, None
            await broken.close()
            raise
        finally:
            self.free.put_nowait(session)

    async def close(self) -> None:
        while not self.free.empty():
            session = self.free.get_nowait()
            if session is not None:
                await session.close()


class EnvironmentLost(RuntimeError):
    """No game can be played any more (the environment server stopped answering): the run stops."""


@dataclass
class GameResult:
    episodes: list[Episode]  # none when the game had no decision or was aborted; a chat agent's may be several
    reward: float
    invalid: bool  # ended by an answer the app's parse_action refused
    aborted: bool = False  # the environment session was lost and could not be restored


@dataclass
class Run:
    """What the loops share. The policy version is the one the generators serve."""

    cfg: RunConfig
    game: object  # the app module: render_prompt, parse_action, reward, ACTIONS
    tokenizer: object
    allowed_token_ids: list[int] | None  # constrained decoding: the only ids the policy may sample
    policy: object  # Service of Generators
    trainer: object  # Trainer actor mesh
    buffer: object  # ReplayBufferActor
    reference: object | None  # Service of ReferenceModels (kl_coef > 0)
    metrics: MetricsLogger
    sessions: SessionPool
    answer_length: int = 1  # constrained decoding: tokens per answer (1: one of the app's ACTIONS)
    chat_server: object = None  # chat-agent apps: the task starting forge_rl.chat_server.ChatServer (forge_rl/agents.py)
    version: int = 0
    step: int = 0
    next_seed: int = 0
    episodes_played: int = 0
    aborted_games: int = 0
    recent: list = field(default_factory=list)  # (reward, invalid) of recent training games
    rollout_errors: int = 0  # groups lost to an unexpected error (logged)
    groups_lost_in_a_row: int = 0  # groups whose every game was aborted, since the last one that was not
    last_abort: str = ""  # why the last aborted game was
    references: dict = field(default_factory=dict)  # "eval/reference/<name>" -> its EV on the eval deals
    last_eval: dict = field(default_factory=dict)  # the last evaluation's figures, for the progress bar
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    batcher: RequestBatcher | None = None  # the games' requests, sent together (forge_rl/batching.py)

    async def generate(self, prompt_ids: list[int], params: dict) -> list[Completion]:
        """One request to the policy service, sent with those of the other games in flight in one call
        to whichever generator replica it routes to."""
        if self.batcher is None:
            send = lambda requests: self.policy.route("generate_batch", requests)  # noqa: E731
            self.batcher = RequestBatcher(send, max_in_flight=len(self.policy.replicas))
        return await self.batcher.generate(prompt_ids, params)


_PROMPTS_WITH_UNKNOWN_WORDS: list[str] = []  # the first one found is reported, once per run


def prompt_ids(game, tokenizer, observation: dict, first_turn: bool, close_previous: bool = False) -> list[int]:
    """Token ids of one user turn and the assistant header, tokenized on their own.

    The first turn comes from the chat template; later turns continue a conversation whose earlier ids
    are kept as sampled, so only the new text is tokenized (never the whole conversation again).
    `close_previous`: the previous answer stopped without the end-of-turn token (constrained decoding
    samples the answer alone), so this turn starts by closing it.
    """
    text, ids = _turn_ids(tokenizer, game.render_prompt(observation), first_turn)
    ids = list(ids)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids and not _PROMPTS_WITH_UNKNOWN_WORDS:
        _PROMPTS_WITH_UNKNOWN_WORDS.append(text)  # the prompt's words are the app's to fix
        logger.warning("the tokenizer does not know some words of this prompt (read as %s): %r", tokenizer.unk_token, text[:300])
    return [tokenizer.eos_token_id] + ids if close_previous else ids


@functools.lru_cache(maxsize=4096)
def _turn_ids(tokenizer, content: str, first_turn: bool) -> tuple[str, tuple[int, ...]]:
    """The text and ids of one user turn (see prompt_ids). Cached: a game's prompts repeat (BlackJack
    has a few hundred), and rendering the chat template three times per turn cost more than the model."""
    message = {"role": "user", "content": content}
    text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    if not first_turn:
        # The turn as the template renders it after an earlier one: without what it puts only at the start
        # (SmolLM2's default system prompt), after the newline it puts after the previous <|im_end|>.
        earlier = [{"role": "user", "content": "."}]
        before = tokenizer.apply_chat_template(earlier, tokenize=False)
        text = "\n" + tokenizer.apply_chat_template(earlier + [message], tokenize=False, add_generation_prompt=True)[len(before):]
    return text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_token_ids(game, tokenizer) -> list[int]:
    """For constrained decoding: the ids the policy may sample, each word of the app's ANSWER_VOCABULARY
    (answers of up to sampling.max_tokens tokens, e.g. "x*7") or else of its ACTIONS (one token each).

    The policy then samples only these ids (vLLM's allowed_token_ids), and the trainer and reference
    renormalise every position over the same ids: behaviour and trained log-probs are of one and the
    same distribution. The end-of-turn token after the answer is then the environment's, appended with
    the next turn (not trained).
    """
    ids = []
    for answer in getattr(game, "ANSWER_VOCABULARY", None) or game.ACTIONS:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(
                f"sampling.constrained needs each answer to be one token; {answer!r} is "
                f"{len(encoded)} tokens for this tokenizer: set sampling.constrained=false"
            )
        if tokenizer.unk_token_id is not None and encoded[0] == tokenizer.unk_token_id:
            raise ConfigError(
                f"answer {answer!r} of {game.__name__}.ACTIONS is not in the model's vocabulary (it is the "
                f"unknown token {tokenizer.unk_token!r}): use words the model knows (docs/blackjack_tiny_cpu.md) or set model.path"
            )
        ids += encoded
    return ids


def sampling(cfg: RunConfig, allowed_token_ids: list[int] | None, greedy: bool = False, answer_length: int = 1) -> dict:
    params = {"temperature": 0.0 if greedy else cfg.sampling.temperature, "max_tokens": cfg.sampling.max_tokens}
    if not greedy:
        params["top_p"] = cfg.sampling.top_p
    if allowed_token_ids:
        params.update(allowed_token_ids=allowed_token_ids, max_tokens=answer_length)
    return params


class SharedRequests:
    """The games of a group ask the policy together: games at the same prompt share one request of n samples.

    A group's games are dealt from one seed and the environment is deterministic in its seed and the
    actions taken, so games that have answered alike so far stand at the same prompt: all G of them at
    the first turn, and at each later turn those that sampled the same answers. One request for n samples
    costs one message and one prefill where n requests cost n of each (on 2 CPU cores per-request
    overhead, not the model, bounds how fast games are played). How many games will reach a prompt is
    known from the request before it: those that drew the same answer there. Each sample goes to one
    game only. A game whose prompt is not the one its siblings reached (an environment that is not
    deterministic in its seed) asks alone. `generate(prompt_ids, sampling) -> list[Completion]`.

    With `seed` (the run's seed and the group's deal) every request carries a vLLM sampling seed derived
    from it, the prompt and how many requests that prompt had before in this group: the group's games
    are then a function of the weights and the deal alone, whatever the timing, so a resumed run samples
    what the uninterrupted run sampled (vLLM gives the n samples of one request seeds seed, seed + 1, ...).
    """

    def __init__(self, generate, group_size: int, sampling: dict, seed: tuple | None = None):
        self.generate, self.group_size, self.sampling, self.seed = generate, group_size, sampling, seed
        self.shared: dict[tuple, list] = {}  # prompt ids -> [future of its n completions, n, how many taken]
        self.reached: dict = {}  # (previous prompt ids, previous answer ids), None first -> prompt reached
        self.requests_at: dict[tuple, int] = {}  # prompt ids -> requests sent for it so far

    def _params(self, prompt: tuple, **extra) -> dict:
        params = {**self.sampling, **extra}
        if self.seed is not None:
            k = self.requests_at[prompt] = self.requests_at.get(prompt, -1) + 1
            params["seed"] = request_seed(self.seed, prompt, k)
        return params

    async def answer(self, prompt_ids: list[int], previous: tuple | None = None) -> Completion:
        """A completion for this game. `previous`: (prompt ids, answer ids) of its previous turn, None on its first."""
        prompt = tuple(prompt_ids)
        if previous is None:
            n = self.group_size
        else:
            before = self.shared.get(previous[0])
            n = sum(tuple(c.token_ids) == previous[1] for c in before[0].result()) if before else 1
        if self.reached.setdefault(previous, prompt) != prompt:
            n = 1
        request = self.shared.get(prompt)
        if request is None and n > 1:
            request = self.shared[prompt] = [asyncio.ensure_future(self.generate(list(prompt), self._params(prompt, n=n))), n, 0]
        if request is None or request[2] >= request[1]:
            (completion,) = await self.generate(list(prompt), self._params(prompt))
            return completion
        index, request[2] = request[2], request[2] + 1  # taken before awaiting: the other games take theirs meanwhile
        return (await asyncio.shield(request[0]))[index]


def request_seed(base: tuple, prompt: tuple, k: int) -> int:
    """A vLLM sampling seed that depends on nothing but its arguments (not on Python's hash salt); 62 bits, as
    vLLM adds the sample index to it and keeps it in an int64."""
    digest = hashlib.blake2b(repr((base, prompt, k)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class GreedyAnswers:
    """An evaluation's answers, one request per distinct prompt: greedy decoding is a function of the
    prompt (and the weights, which do not change during an evaluation), so games that reach the same
    prompt get the same answer without asking again. Thousands of deals then cost a few hundred
    requests, and evaluating on many deals (a precise EV) costs little more than on a few."""

    def __init__(self, generate, sampling: dict):
        self.generate, self.sampling = generate, sampling
        self.answers: dict[tuple, asyncio.Future] = {}  # prompt ids -> future of its one completion

    async def answer(self, prompt_ids: list[int], previous: tuple | None = None) -> Completion:
        prompt = tuple(prompt_ids)
        if prompt not in self.answers:
            self.answers[prompt] = asyncio.ensure_future(self.generate(list(prompt), self.sampling))
        return (await asyncio.shield(self.answers[prompt]))[0]


async def play_game(
    run: Run, seed: int, group_id: str, asks: SharedRequests | GreedyAnswers, reset_args: dict | None = None
) -> GameResult:
    """One whole game on its own environment session: observe, ask the policy, act, until done.
    `asks`: where the game's answers come from, shared with the other games of its group or evaluation.
    `reset_args`: besides the seed (the config's env.reset_args, or with eval.reset_args over them)."""
    cfg, game = run.cfg, run.game
    async with run.sessions.session() as session:
        try:
            observation = (await session.reset(seed=seed, **(reset_args or cfg.env.reset_args))).observation
            conversation, invalid = Conversation(prompt_ids(game, run.tokenizer, observation, True)), False
            previous = None  # (prompt ids, answer ids) of the last turn, for the group's shared requests
            for turn in range(cfg.rollout.max_turns):
                if observation["done"]:
                    break
                if turn:
                    unclosed = conversation.tokens[-1] != run.tokenizer.eos_token_id
                    conversation.add_turn(prompt_ids(game, run.tokenizer, observation, False, unclosed))
                completion = await asks.answer(conversation.prompt_ids, previous)
                previous = (tuple(completion.prompt_ids), tuple(completion.token_ids))
                conversation.add_completion(completion)
                action = game.parse_action(completion.text, observation)
                if action is None:
                    invalid = True
                    break
                observation = (await session.step(action)).observation
        except EpisodeAborted as e:
            logger.warning("game on seed %d dropped: %s", seed, e)
            run.last_abort = str(e)
            return GameResult([], 0.0, False, aborted=True)
    reward = game.reward(observation, invalid, cfg.rollout.invalid_action_penalty)
    episodes = [conversation.to_episode(reward, group_id)] if conversation.versions else []
    return GameResult(episodes, reward, invalid)


def player(run: Run):
    """play_game, or for a chat-agent app (one with run_agent) forge_rl.agents.play_agent: same arguments and result."""
    if hasattr(run.game, "run_agent"):
        from forge_rl.agents import play_agent

        return play_agent
    return play_game


async def play_group(run: Run, seed: int) -> list[Episode] | None:
    """G games dealt from one seed: the group GRPO compares (same cards, different decisions)."""
    shared = SharedRequests(
        run.generate, run.cfg.grpo.group_size, sampling(run.cfg, run.allowed_token_ids, answer_length=run.answer_length),
        seed=(run.cfg.seed, seed),
    )
    results = await asyncio.gather(
        *(player(run)(run, seed, f"seed{seed}", shared) for _ in range(run.cfg.grpo.group_size))
    )
    run.episodes_played += len(results)
    run.aborted_games += sum(r.aborted for r in results)
    run.groups_lost_in_a_row = run.groups_lost_in_a_row + 1 if all(r.aborted for r in results) else 0
    if run.groups_lost_in_a_row >= 20:
        raise EnvironmentLost(
            f"every game of the last {run.groups_lost_in_a_row} groups was aborted (last: {run.last_abort}): "
            "the environment server is gone; check env.url / env.server"
        )
    run.recent = (run.recent + [(r.reward, r.invalid) for r in results if not r.aborted])[-2000:]
    episodes = [e for r in results for e in r.episodes]
    return episodes if all(r.episodes for r in results) else None  # a group with a dropped game is not comparable


# ---------------------------------------------------------------------------------------------------
# The loops


async def rollout_worker(run: Run) -> None:
    """Plays groups with whatever weights the policy serves now; waits only while a batch is ready.

    An unexpected error loses that group (logged and counted) and the worker goes on; errors on
    every one of many groups in a row mean something is broken, and stop the run with the error.
    """
    failures_in_a_row = 0
    while not run.stopping.is_set():
        # Back-pressure: one batch waiting is enough; more would only go stale while taking the
        # trainer's CPU (on a small machine they share it).
        if (await call(run.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S))["groups"] >= run.cfg.grpo.batch_size:
            await asyncio.sleep(0.05)
            continue
        seed, run.next_seed = run.next_seed, run.next_seed + 1
        try:
            group = await play_group(run, seed)
            if group:
                await call(run.buffer, "add", group, timeout_s=BUFFER_TIMEOUT_S)
            failures_in_a_row = 0
        except EnvironmentLost:
            raise
        except Exception as e:
            run.rollout_errors += 1
            failures_in_a_row += 1
            logger.warning("group on seed %d lost: %s", seed, str(e).splitlines()[0] if str(e) else repr(e))
            if failures_in_a_row >= 20:
                raise
            await asyncio.sleep(0.5)


async def train_one_step(run: Run, batch: list[Episode]) -> dict:
    """Train on `batch`, then make every generator serve the new weights (version v+1)."""
    clock = time.perf_counter()
    ref_logprobs = None
    if run.reference is not None:
        ref_logprobs = await run.reference.route("logprobs", [e.tokens for e in batch])
    timeout_s = run.cfg.trainer.timeout_s
    metrics = await call(run.trainer, "train_step", batch, ref_logprobs, timeout_s=timeout_s)
    trained = time.perf_counter()
    run.version, run.step = run.version + 1, run.step + 1
    await call(run.trainer, "push_weights", run.version, timeout_s=timeout_s)
    pushed = time.perf_counter()
    await run.policy.fanout("update_weights", run.version)
    if run.version - 1 >= 1:  # version 0 is the model directory itself; older versions are no longer served
        await store.delete_version(run.version - 1)
    metrics.update(train_s=trained - clock, push_s=pushed - trained, load_s=time.perf_counter() - pushed)
    return metrics


async def check_groups_have_spread(run: Run, filtered_at_step: int) -> None:
    """Fail loud instead of sampling forever: with DAPO's filter, a collapsed policy (every game of every
    group decided alike, so equal rewards) never fills a batch again."""
    filtered = (await call(run.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S))["filtered_zero_spread"] - filtered_at_step
    if filtered > 50 * run.cfg.grpo.batch_size:
        raise RuntimeError(
            f"{filtered} groups since the last train step had equal rewards: the policy has collapsed (entropy near 0). "
            "Raise grpo.entropy_coef or grpo.group_size, lower trainer.optimizer.lr, or set grpo.filter_zero_spread=false"
        )


async def train(run: Run, progress, workers: list[asyncio.Task]) -> None:
    """The training loop: batch -> step -> weights out -> (eval, checkpoint) until max_steps."""
    cfg = run.cfg
    start, episodes_at_start = time.time(), run.episodes_played
    while run.step < cfg.trainer.max_steps:
        filtered_at_step = (await call(run.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S))["filtered_zero_spread"]
        waiting_since = time.time()
        if cfg.synchronous:  # the buffer keeps no data of an older version (start: max_policy_age 0)
            batch = []
            while len(batch) < cfg.grpo.batch_size * cfg.grpo.group_size:
                seeds = range(run.next_seed, run.next_seed + cfg.rollout.num_workers)
                run.next_seed += cfg.rollout.num_workers
                groups = [g for g in await asyncio.gather(*(play_group(run, s) for s in seeds)) if g]
                # one message for all of them, in seed order: the batch is the same whatever the timing
                await call(run.buffer, "add_groups", groups, timeout_s=BUFFER_TIMEOUT_S)
                batch = await call(run.buffer, "sample", run.version, timeout_s=BUFFER_TIMEOUT_S) or []
                await check_groups_have_spread(run, filtered_at_step)
                waiting_since = await warn_if_stalled(run, waiting_since)
        else:
            batch = await call(run.buffer, "sample", run.version, timeout_s=BUFFER_TIMEOUT_S)
            if batch is None:
                await check_groups_have_spread(run, filtered_at_step)
                for worker in workers:
                    if worker.done() and not worker.cancelled() and worker.exception():
                        raise RuntimeError("a rollout worker stopped; no more data is coming") from worker.exception()
                waiting_since = await warn_if_stalled(run, waiting_since)
                await asyncio.sleep(0.05)
                continue
        metrics = await train_one_step(run, batch)
        rewards = [r for r, _ in run.recent[-500:]]
        values = {
            "train/loss": metrics["loss"],
            "train/reward": sum(rewards) / max(len(rewards), 1),
            "train/invalid_rate": sum(i for _, i in run.recent[-500:]) / max(len(rewards), 1),
            "train/batch_reward": metrics["reward_mean"],
            "train/entropy": metrics.get("entropy", float("nan")),
            "train/kl": metrics.get("kl", 0.0),
            "train/clip_fraction": metrics.get("clip_fraction", 0.0),
            "train/grad_norm": metrics["grad_norm"],
            "train/ratio_max": metrics["ratio_max"],
            "train/behaviour_kl": metrics["behaviour_kl"],
            "train/is_masked_fraction": metrics.get("is_masked_fraction", 0.0),
            "train/mixed_version_episodes": metrics["mixed_version_episodes"],
            "train/policy_age": run.version - 1 - metrics["policy_version_min"],
            "train/episodes_per_s": (run.episodes_played - episodes_at_start) / (time.time() - start),
            "train/lr": metrics["lr"],
            "train/policy_version": run.version,
            "time/train_step_s": metrics["train_s"],
            "time/push_weights_s": metrics["push_s"],
            "time/update_weights_s": metrics["load_s"],
        }
        values.update({f"train/{k}": v for k, v in metrics.items() if "/age_" in k})  # ratio extremes by token age
        values.update({f"buffer/{k}": v for k, v in (await call(run.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S)).items()})
        values.update({"rollout/errors": run.rollout_errors, "rollout/aborted_games": run.aborted_games})
        if cfg.eval.interval and (run.step % cfg.eval.interval == 0 or run.step == cfg.trainer.max_steps):  # and the final policy
            run.last_eval = await evaluate(run)
            values.update(run.last_eval)
            progress.write(f"step {run.step} {figures(run.last_eval)}  |  reference: {figures(run.references) or 'none'}")
        run.metrics.log(run.step, values)
        progress.update(1)
        # The app's headline figures (the first two of its evaluation) as of the last evaluation.
        headline = {k.split("/")[-1]: f"{v:+.3f}" for k, v in list(run.last_eval.items())[:2]}
        progress.set_postfix(reward=f"{values['train/reward']:+.3f}", **headline, eps=f"{values['train/episodes_per_s']:.1f}/s")
        if cfg.trainer.checkpoint_every and (run.step % cfg.trainer.checkpoint_every == 0 or run.step == cfg.trainer.max_steps):
            await save_checkpoint(run)  # and at the end, so that a run can be continued with more steps


async def warn_if_stalled(run: Run, since: float) -> float:
    """Every STALL_WARNING_S without a train step, say what the loop waits for; returns when it last
    said so (or `since`)."""
    if time.time() - since < STALL_WARNING_S:
        return since
    stats = await call(run.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S)
    logger.warning(
        "no train step for %.0f s: the replay buffer holds %d of the %d groups a step needs (groups added %d, "
        "refused for equal rewards %d, evicted as older than max_policy_age %d; games played %d, aborted %d, "
        "groups lost to errors %d)",
        time.time() - since, stats["groups"], run.cfg.grpo.batch_size, stats["added"], stats["filtered_zero_spread"],
        stats["evicted_stale"], run.episodes_played, run.aborted_games, run.rollout_errors,
    )
    return time.time()


def figures(values: dict) -> str:
    """'ev=-0.052 win=0.431 ...': a dict of metrics as the console shows them."""
    return " ".join(f"{k.removeprefix('eval/reference/').removeprefix('eval/')}={v:.3f}" for k, v in values.items())


def eval_reset_args(cfg: RunConfig) -> dict:
    return {**cfg.env.reset_args, **cfg.eval.reset_args}


async def play_reference(run: Run, policy, seed: int) -> float | None:
    """One game of a reference policy (observation -> action text, or None where it has no answer) on
    its own session: its return, None if it had no answer."""
    async with run.sessions.session() as session:
        observation = (await session.reset(seed=seed, **eval_reset_args(run.cfg))).observation
        while not observation["done"]:
            answer = policy(observation)
            if answer is None:
                return None
            observation = (await session.step(run.game.parse_action(answer, observation))).observation
    return run.game.reward(observation, False, 0.0)


async def evaluate_references(run: Run) -> dict[str, float]:
    """The app's REFERENCE_POLICIES (if it has any) on the evaluation deals: what the model's EV is read
    against, free of the deals' luck. Played once per run."""
    cfg, values = run.cfg.eval, {}
    for name, policy in getattr(run.game, "REFERENCE_POLICIES", {}).items():
        returns = await asyncio.gather(*(play_reference(run, policy, s) for s in range(cfg.seed, cfg.seed + cfg.num_games)))
        returns = [r for r in returns if r is not None]
        if returns:
            values[f"eval/reference/{name}"] = sum(returns) / len(returns)
    return values


async def evaluate(run: Run) -> dict[str, float]:
    """Greedy play on the fixed deals eval.seed ... eval.seed + num_games - 1 with the current weights."""
    cfg = run.cfg.eval
    greedy = GreedyAnswers(run.generate, sampling(run.cfg, run.allowed_token_ids, greedy=True, answer_length=run.answer_length))
    reset_args = eval_reset_args(run.cfg)
    results = await asyncio.gather(
        *(player(run)(run, s, f"eval{s}", greedy, reset_args) for s in range(cfg.seed, cfg.seed + cfg.num_games))
    )
    done = [r for r in results if not r.aborted]
    if not done:
        logger.warning("evaluation: all %d games were aborted; no evaluation at step %d", len(results), run.step)
        return {"eval/games": 0}
    mean = sum(r.reward for r in done) / len(done)
    app_metrics = getattr(run.game, "eval_metrics", None)  # the app's own figures, its headline first
    values = app_metrics(done) if app_metrics else {"eval/reward": mean, "eval/games": len(done)}
    first = next(iter(values))
    return {first: values.pop(first), **luck_corrected(run, mean), **values}


def luck_corrected(run: Run, ev: float) -> dict[str, float]:
    """The eval EV with the deals' luck taken out: EV - EV of a reference policy on the same deals + that
    policy's exact EV (a control variate; the app's first REFERENCE_EV). 10,000 deals leave the raw EV
    +-0.02 (95%) from the truth, mostly luck the model shares with the reference policy on the same
    cards; the difference of the two is several times more precise."""
    exact = getattr(run.game, "REFERENCE_EV", {})
    name = next(iter(exact), None)
    on_these_deals = run.references.get(f"eval/reference/{name}")
    if on_these_deals is None:
        return {}
    return {"eval/ev_luck_corrected": ev - on_these_deals + exact[name]}


# ---------------------------------------------------------------------------------------------------
# Checkpoints: the trainer's state (torch.distributed.checkpoint) plus where the loops were.


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


async def save_checkpoint(run: Run) -> None:
    """The trainer's state, and beside it where the loops were (progress.json); latest.json is a copy of
    the newest one. Paths are relative to the checkpoints folder, so a run directory can be moved or
    copied, and any checkpoint resumed from by copying its progress.json over latest.json."""
    folder = checkpoint_dir(Path(run.cfg.run_dir))
    path = folder / f"step_{run.step:06d}"
    await call(run.trainer, "save_checkpoint", str(path), timeout_s=run.cfg.trainer.timeout_s)
    progress = json.dumps({"step": run.step, "version": run.version, "next_seed": run.next_seed, "path": path.name})
    for pointer in (path / "progress.json", folder / "latest.json"):
        pointer.with_suffix(".tmp").write_text(progress)
        pointer.with_suffix(".tmp").replace(pointer)  # atomic: a crash never leaves a half-written pointer


async def resume(run: Run) -> None:
    latest = checkpoint_dir(Path(run.cfg.run_dir)) / "latest.json"
    if not latest.exists():
        raise ConfigError(f"resume=true but {latest} does not exist: no checkpoint to resume from")
    progress = json.loads(latest.read_text())
    path = latest.parent / progress["path"]  # relative (an absolute path, as older runs wrote, stays as is)
    restored = await call(run.trainer, "load_checkpoint", str(path), timeout_s=run.cfg.trainer.timeout_s)
    run.step, run.version, run.next_seed = progress["step"], restored["policy_version"], progress["next_seed"]
    run.metrics.drop_after(run.step)  # the rows of steps after the checkpoint are logged again
    await call(run.trainer, "push_weights", run.version, timeout_s=run.cfg.trainer.timeout_s)
    await run.policy.fanout("update_weights", run.version)
    logger.info("resumed at step %d, policy version %d", run.step, run.version)


# ---------------------------------------------------------------------------------------------------
# Set-up and tear-down


def prepare_model(cfg: RunConfig) -> str:
    """A local HF directory for both engines, whatever model.path names (forge_rl/models.py)."""
    from forge_rl.models import resolve_model

    return resolve_model(cfg.model.path, cfg.model.dtype, Path(cfg.run_dir) / "tiny_model", cfg.model.tiny_seed)


def load_app_module(name: str, constrained: bool):
    """The config's app_module, checked for the functions training calls (a one-line error if not)."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"app_module {name!r} cannot be imported: {e}") from None
    needed = ["run_agent"] if hasattr(module, "run_agent") else ["render_prompt", "parse_action", "reward"]
    missing = [n for n in needed if not hasattr(module, n)]
    if constrained and not (hasattr(module, "ACTIONS") or hasattr(module, "ANSWER_VOCABULARY")):
        missing.append("ACTIONS or ANSWER_VOCABULARY (sampling.constrained)")
    if missing:
        raise ConfigError(f"app_module {name!r} lacks {', '.join(missing)}")
    return module


async def start(cfg: RunConfig, game, url: str) -> Run:
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    allowed = answer_token_ids(game, tokenizer) if cfg.sampling.constrained else None
    hosts = {"trainer": cfg.trainer.hosts, "generator": cfg.generator.hosts}
    if cfg.grpo.kl_coef > 0:
        hosts["reference"] = cfg.reference.hosts
    provisioner = get_provisioner()
    await provisioner.use_cluster(cfg.cluster, hosts)  # a no-op unless cluster.workers/kubernetes is set
    gpus = provisioner.has_gpus()  # this host's, or the workers' (a controller pod may have none)
    weights_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    generator_hosts = [provisioner.host_of("generator", i, cfg.generator.hosts) for i in range(cfg.generator.num_replicas)]
    try:  # by where trainer rank 0 and each replica will run (weight_sync.plan)
        plan = await weight_sync.plan(cfg.generator.weight_sync, provisioner.host_of("trainer"), generator_hosts, weights_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sync = plan.kind
    logger.info("weight sync: %s (generator.weight_sync: %s)", sync, cfg.generator.weight_sync)
    await store.start()
    policy, trainer, buffer, reference = await start_all(  # one that fails stops the others
        Generator.options(
            procs=cfg.generator.procs, with_gpus=gpus, num_replicas=cfg.generator.num_replicas,
            hosts=cfg.generator.hosts, role="generator",
        ).as_service(model_path, cfg.model.dtype, cfg.generator, cfg.seed),
        Trainer.options(procs=cfg.trainer.procs, with_gpus=gpus, hosts=cfg.trainer.hosts, role="trainer").as_actor(
            model_path, cfg.grpo, cfg.trainer.optimizer, cfg.trainer.max_steps, cfg.model.dtype,
            micro_batch_size=cfg.trainer.micro_batch_size, allowed_token_ids=allowed, temperature=cfg.sampling.temperature,
            weight_sync=sync,
        ),
        ReplayBufferActor.options().as_actor(  # synchronous: on-policy, no group of an older version is kept
            cfg.grpo.batch_size, 0 if cfg.synchronous else cfg.grpo.max_policy_age, filter_zero_spread=cfg.grpo.filter_zero_spread
        ),
        _maybe_reference(cfg, model_path, gpus, allowed),
    )
    if sync == "broadcast":  # a replica restarted later is not in the group: its updates time out
        replicas = [r.actor for r in policy.replicas]
        await weight_sync.connect_broadcast(
            trainer, replicas, cfg.generator.procs, plan.rendezvous, plan.binds, await plan.trainer_host.free_port()
        )
    run = Run(
        cfg=cfg,
        game=game,
        tokenizer=tokenizer,
        allowed_token_ids=allowed,
        policy=policy,
        trainer=trainer,
        buffer=buffer,
        reference=reference,
        metrics=MetricsLogger(run_dir, cfg.logging),
        sessions=SessionPool(url, cfg.env.max_concurrent, cfg.env.timeout_s),
        answer_length=cfg.sampling.max_tokens if getattr(game, "ANSWER_VOCABULARY", None) else 1,
        next_seed=cfg.seed * 1_000_000,
    )
    policy.after_restart = faults.catch_up  # a restarted generator loads the current weights before taking calls
    return run


async def _maybe_reference(cfg: RunConfig, model_path: str, gpus: bool, allowed: list[int] | None):
    if cfg.grpo.kl_coef <= 0:
        return None
    return await ReferenceModel.options(
        num_replicas=cfg.reference.num_replicas, with_gpus=gpus, hosts=cfg.reference.hosts, role="reference"
    ).as_service(
        model_path, cfg.model.dtype, allowed_token_ids=allowed, temperature=cfg.sampling.temperature
    )


async def shutdown(run: Run | None) -> None:
    """Stop every actor and its processes (also on Ctrl-C), so no process outlives the run.

    On a cluster, a host that died first gets named, with the roles it ran (the error that stopped the
    run, a Monarch SupervisionError, follows).
    """
    provisioner = get_provisioner()
    lost = [f"{h.worker} ({h.address}), which ran {', '.join(h.running.values()) or 'nothing'}" for h in await provisioner.lost_hosts()]
    if run is not None:
        for task in (run.policy.stop(), stop(run.trainer), stop(run.buffer), run.reference.stop() if run.reference else None):
            if task is not None:
                try:
                    await task
                except Exception as e:
                    logger.warning("while shutting down: %s", e)
    if run is not None and run.chat_server is not None:
        from forge_rl.agents import stop_chat_server

        await stop_chat_server(run)
    await store.stop()
    weight_sync.remove_orphaned_buffers()
    await provisioner.stop()
    if run is not None:
        await run.sessions.close()
        run.metrics.close()
    for host in lost:
        print(f"forge_rl: lost host {host}. The run stopped; resume=true continues from its last checkpoint", file=sys.stderr)


def console_to_log(run_dir: Path) -> Path:
    """Send what every process prints (vLLM's and Monarch's INFO lines, the per-update RotaryEmbedding
    warning of vLLM's weight reload) to run_dir/run.log, and keep this process's sys.stdout/sys.stderr
    (the progress bar, the evaluation lines, warnings and a failure's traceback) on the console.

    Done on file descriptors 1 and 2, which the actor and engine processes inherit; Python's own
    streams are re-opened on copies of the console's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "run.log"
    sys.stdout.flush(), sys.stderr.flush()
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    return log


def exit_within(seconds: float, code: int) -> None:
    """End the process with `code` even if the interpreter's exit hangs. After a host was lost, a Monarch
    runtime thread was seen to keep the exit waiting after main had returned; a daemon timer ends the
    process then (the run has already stopped its actors and said why)."""

    def leave():
        sys.stderr.write(f"forge_rl: the interpreter did not exit within {seconds:g} s; leaving with status {code}\n")
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, leave)
    timer.daemon = True
    timer.start()


def print_task_stacks() -> None:
    """`kill -USR1 <pid>` prints where every asyncio task of the controller is waiting."""
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)


async def main(cfg: RunConfig) -> None:
    from tqdm import tqdm

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, print_task_stacks)
    run_dir = Path(cfg.run_dir)
    game = load_app_module(cfg.app_module, cfg.sampling.constrained)  # fails before anything starts
    if cfg.env.server is not None:  # else its failure to start would be the server's whole traceback
        try:
            if ":" in cfg.env.server:
                load_env_class(cfg.env.server)
            elif importlib.util.find_spec(cfg.env.server) is None:
                raise ValueError(f"no module named {cfg.env.server!r}")
        except (ValueError, ImportError) as e:
            raise ConfigError(f"env.server: {e}") from None
    dump(cfg, run_dir / "config.yaml")  # the resolved config, to reproduce the run
    print(f"logs of every process (vLLM, Monarch): {run_dir / 'run.log'}")
    url, local_server = env_url(cfg.env.url, cfg.env.server, cfg.env.max_concurrent)
    if cfg.env.url is not None:  # a running server: the session pool never holds more sessions than it accepts
        size = faults.fit_sessions_to_server(url, cfg.env.max_concurrent, cfg.grpo.group_size, cfg.env.timeout_s)
        cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_concurrent=size))
    run = None
    try:
        run = await start(cfg, game, url)
        if cfg.resume:
            await resume(run)
        if cfg.eval.interval:
            run.references = await evaluate_references(run)
            if not cfg.resume:  # a resumed run's log has them already
                run.metrics.log(run.step, run.references)
            print(f"reference policies on the evaluation seeds: {figures(run.references) or 'none'}")
        progress = tqdm(total=cfg.trainer.max_steps, initial=run.step, desc=f"GRPO {cfg.app_module}", dynamic_ncols=True)
        workers = [] if cfg.synchronous else [asyncio.create_task(rollout_worker(run)) for _ in range(cfg.rollout.num_workers)]
        try:
            await faults.watch_trainer(run, train(run, progress, workers))  # a dead trainer stops it within seconds
        finally:
            run.stopping.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            progress.close()
        print(f"done: {run.step} steps, policy version {run.version}")
    finally:
        if run is not None and run.step:  # also after Ctrl-C: the curve of what was done
            labels = {f"{k.split('/')[-1]} {v:+.3f} on these deals": v for k, v in run.references.items()}
            headline = {k: f"eval {k.split('/')[-1]} (greedy)" for k in list(run.last_eval)[:2]}
            curve = plot_curves(run_dir, {"train/reward": "training reward", **headline}, labels)
            print(f"learning curve: {curve}", file=sys.stderr)
        await shutdown(run)
        if local_server is not None:
            local_server.stop()


if __name__ == "__main__":
    config = parse_cli()
    log_file = console_to_log(Path(config.run_dir))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM (kubectl delete, timeout, a scheduler) stops the run like Ctrl-C: actors and engine processes
    # shut down. Left to its default it would kill this process alone and orphan vLLM's engine processes.
    # SIGINT is restored first: a run started in the background by a script inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    code = 0
    try:
        asyncio.run(faults.restarting(main, config))  # again from the last checkpoint if trainer.restart_on_failure
    except faults.TrainerLost as e:
        print(f"stopped: {e}", file=sys.stderr)
        code = 1
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted: actors stopped, checkpoints kept in", Path(config.run_dir) / "checkpoints", file=sys.stderr)
        code = 130
    except Exception:
        print(f"failed (the traceback below); every process's output is in {log_file}", file=sys.stderr)
        traceback.print_exc()
        code = 1
    exit_within(EXIT_GRACE_S, code)
    sys.exit(code)
