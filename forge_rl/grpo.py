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
import importlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge_rl import store
from forge_rl.actor import stop
from forge_rl.config import RunConfig, dump, parse_cli
from forge_rl.envs.client import EnvSession, EpisodeAborted, env_url
from forge_rl.generator import Generator
from forge_rl.metrics import MetricsLogger, plot_curves
from forge_rl.reference import ReferenceModel
from forge_rl.replay_buffer import ReplayBufferActor
from forge_rl.rollout import Conversation
from forge_rl.trainer import Trainer
from forge_rl.types import Completion, Episode

logger = logging.getLogger("forge_rl.grpo")


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


@dataclass
class GameResult:
    episodes: list[Episode]  # none when the game had no decision or was aborted; a chat agent's may be several
    reward: float
    invalid: bool  # ended by an answer that was neither HIT nor STAND
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
    chat_server: object = None  # chat-agent apps: the task starting forge_rl.chat_server.ChatServer (forge_rl/agents.py)
    version: int = 0
    step: int = 0
    next_seed: int = 0
    episodes_played: int = 0
    aborted_games: int = 0
    recent: list = field(default_factory=list)  # (reward, invalid) of recent training games
    rollout_errors: int = 0  # groups lost to an unexpected error (logged)
    references: dict = field(default_factory=dict)  # "eval/reference/<name>" -> its EV on the eval deals
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, prompt_ids: list[int], params: dict) -> list[Completion]:
        """One request to the policy service (whichever generator replica it routes to)."""
        return await self.policy.route("generate", prompt_ids, params)


def prompt_ids(game, tokenizer, observation: dict, first_turn: bool, close_previous: bool = False) -> list[int]:
    """Token ids of one user turn and the assistant header, tokenized on their own.

    The first turn comes from the chat template; later turns continue a conversation whose earlier ids
    are kept as sampled, so only the new text is tokenized (never the whole conversation again).
    `close_previous`: the previous answer stopped without the end-of-turn token (constrained decoding
    samples the answer alone), so this turn starts by closing it.
    """
    message = [{"role": "user", "content": game.render_prompt(observation)}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    if not first_turn:
        text = "\n" + text  # the newline the chat template puts after the previous <|im_end|>
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.eos_token_id] + ids if close_previous else ids


def answer_token_ids(game, tokenizer) -> list[int]:
    """For constrained decoding: the ids of the app's answers, each of which must be one token.

    The policy then samples exactly one of these ids per turn (vLLM's allowed_token_ids, max_tokens 1),
    so every answer is valid by construction, and the trainer and reference renormalise over the same
    ids: behaviour and trained log-probs are of one and the same distribution. The end-of-turn token
    after the answer is then the environment's, appended with the next turn (not trained).
    """
    ids = []
    for answer in game.ACTIONS:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise SystemExit(
                f"config error: sampling.constrained needs each answer to be one token; {answer!r} is "
                f"{len(encoded)} tokens for this tokenizer: set sampling.constrained=false"
            )
        ids += encoded
    return ids


def sampling(cfg: RunConfig, allowed_token_ids: list[int] | None, greedy: bool = False) -> dict:
    params = {"temperature": 0.0 if greedy else cfg.sampling.temperature, "max_tokens": cfg.sampling.max_tokens}
    if not greedy:
        params["top_p"] = cfg.sampling.top_p
    if allowed_token_ids:
        params.update(allowed_token_ids=allowed_token_ids, max_tokens=1)
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
    """

    def __init__(self, generate, group_size: int, sampling: dict):
        self.generate, self.group_size, self.sampling = generate, group_size, sampling
        self.shared: dict[tuple, list] = {}  # prompt ids -> [future of its n completions, n, how many taken]
        self.reached: dict = {}  # (previous prompt ids, previous answer ids), None first -> prompt reached

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
            request = self.shared[prompt] = [asyncio.ensure_future(self.generate(list(prompt), {**self.sampling, "n": n})), n, 0]
        if request is None or request[2] >= request[1]:
            (completion,) = await self.generate(list(prompt), self.sampling)
            return completion
        index, request[2] = request[2], request[2] + 1  # taken before awaiting: the other games take theirs meanwhile
        return (await asyncio.shield(request[0]))[index]


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
    run: Run, seed: int, group_id: str, asks: SharedRequests | GreedyAnswers
) -> GameResult:
    """One whole game on its own environment session: observe, ask the policy, act, until done.
    `asks`: where the game's answers come from, shared with the other games of its group or evaluation."""
    cfg, game = run.cfg, run.game
    async with run.sessions.session() as session:
        try:
            observation = (await session.reset(seed=seed)).observation
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
                action = game.parse_action(completion.text)
                if action is None:
                    invalid = True
                    break
                observation = (await session.step(action)).observation
        except EpisodeAborted as e:
            logger.warning("game on seed %d dropped: %s", seed, e)
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
    shared = SharedRequests(run.generate, run.cfg.grpo.group_size, sampling(run.cfg, run.allowed_token_ids))
    results = await asyncio.gather(
        *(player(run)(run, seed, f"seed{seed}", shared) for _ in range(run.cfg.grpo.group_size))
    )
    run.episodes_played += len(results)
    run.aborted_games += sum(r.aborted for r in results)
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
        if (await run.buffer.stats.call_one())["groups"] >= run.cfg.grpo.batch_size:
            await asyncio.sleep(0.05)
            continue
        seed, run.next_seed = run.next_seed, run.next_seed + 1
        try:
            group = await play_group(run, seed)
            if group:
                await run.buffer.add.call_one(group)
            failures_in_a_row = 0
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
    metrics = (await run.trainer.train_step.call(batch, ref_logprobs)).item(procs=0)
    trained = time.perf_counter()
    run.version, run.step = run.version + 1, run.step + 1
    await run.trainer.push_weights.call(run.version)
    pushed = time.perf_counter()
    await run.policy.fanout("update_weights", run.version)
    if run.version - 1 >= 1:  # version 0 is the model directory itself; older versions are no longer served
        await store.delete_version(run.version - 1)
    metrics.update(train_s=trained - clock, push_s=pushed - trained, load_s=time.perf_counter() - pushed)
    return metrics


async def check_groups_have_spread(run: Run, filtered_at_step: int) -> None:
    """Fail loud instead of sampling forever: with DAPO's filter, a collapsed policy (every game of every
    group decided alike, so equal rewards) never fills a batch again."""
    filtered = (await run.buffer.stats.call_one())["filtered_zero_spread"] - filtered_at_step
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
        filtered_at_step = (await run.buffer.stats.call_one())["filtered_zero_spread"]
        if cfg.synchronous:
            batch = []
            while len(batch) < cfg.grpo.batch_size * cfg.grpo.group_size:
                seeds = range(run.next_seed, run.next_seed + cfg.rollout.num_workers)
                run.next_seed += cfg.rollout.num_workers
                for group in await asyncio.gather(*(play_group(run, s) for s in seeds)):
                    if group:
                        await run.buffer.add.call_one(group)
                batch = await run.buffer.sample.call_one(run.version) or []
                await check_groups_have_spread(run, filtered_at_step)
        else:
            batch = await run.buffer.sample.call_one(run.version)
            if batch is None:
                await check_groups_have_spread(run, filtered_at_step)
                for worker in workers:
                    if worker.done() and not worker.cancelled() and worker.exception():
                        raise RuntimeError("a rollout worker stopped; no more data is coming") from worker.exception()
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
            "train/policy_age": run.version - 1 - metrics["policy_version_min"],
            "train/episodes_per_s": (run.episodes_played - episodes_at_start) / (time.time() - start),
            "train/lr": metrics["lr"],
            "train/policy_version": run.version,
            "time/train_step_s": metrics["train_s"],
            "time/push_weights_s": metrics["push_s"],
            "time/update_weights_s": metrics["load_s"],
        }
        values.update({f"buffer/{k}": v for k, v in (await run.buffer.stats.call_one()).items()})
        values.update({"rollout/errors": run.rollout_errors, "rollout/aborted_games": run.aborted_games})
        if cfg.eval.interval and (run.step % cfg.eval.interval == 0 or run.step == cfg.trainer.max_steps):  # and the final policy
            values.update(await evaluate(run))
        run.metrics.log(run.step, values)
        progress.update(1)
        progress.set_postfix(
            reward=f"{values['train/reward']:+.3f}",
            ev=f"{values.get('eval/ev', float('nan')):+.3f}",
            ev_corrected=f"{values.get('eval/ev_luck_corrected', float('nan')):+.3f}",
            eps=f"{values['train/episodes_per_s']:.1f}/s",
        )
        if cfg.trainer.checkpoint_every and run.step % cfg.trainer.checkpoint_every == 0:
            await save_checkpoint(run)


async def play_reference(run: Run, policy, seed: int) -> float:
    """One game of a reference policy (observation -> action text) on its own session: its return."""
    async with run.sessions.session() as session:
        observation = (await session.reset(seed=seed)).observation
        while not observation["done"]:
            observation = (await session.step(run.game.parse_action(policy(observation)))).observation
    return run.game.reward(observation, False, 0.0)


async def evaluate_references(run: Run) -> dict[str, float]:
    """The app's REFERENCE_POLICIES (if it has any) on the evaluation deals: what the model's EV is read
    against, free of the deals' luck. Played once per run."""
    cfg, values = run.cfg.eval, {}
    for name, policy in getattr(run.game, "REFERENCE_POLICIES", {}).items():
        returns = await asyncio.gather(*(play_reference(run, policy, s) for s in range(cfg.seed, cfg.seed + cfg.num_games)))
        values[f"eval/reference/{name}"] = sum(returns) / len(returns)
    return values


async def evaluate(run: Run) -> dict[str, float]:
    """Greedy play on the fixed deals eval.seed ... eval.seed + num_games - 1 with the current weights."""
    cfg = run.cfg.eval
    greedy = GreedyAnswers(run.generate, sampling(run.cfg, run.allowed_token_ids, greedy=True))
    results = await asyncio.gather(
        *(player(run)(run, s, f"eval{s}", greedy) for s in range(cfg.seed, cfg.seed + cfg.num_games))
    )
    done = [r for r in results if not r.aborted] or [GameResult([], 0.0, False)]
    n, ev = len(done), sum(r.reward for r in done) / len(done)
    return {
        "eval/ev": ev,
        **luck_corrected(run, ev),
        "eval/win": sum(r.reward > 0 for r in done) / n,
        "eval/push": sum(r.reward == 0 and not r.invalid for r in done) / n,
        "eval/loss": sum(r.reward < 0 for r in done) / n,
        "eval/invalid_rate": sum(r.invalid for r in done) / n,
        "eval/games": n,
    }


def luck_corrected(run: Run, ev: float) -> dict[str, float]:
    """The eval EV with the deals' luck taken out: EV - EV of a reference policy on the same deals + that
    policy's exact EV (a control variate; the app's first REFERENCE_EV). 10,000 deals leave the raw EV
    +-0.02 (95%) from the truth, mostly luck the model shares with the reference policy on the same
    cards; the difference of the two is several times more precise (shared/reference/blackjack.md)."""
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
    path = checkpoint_dir(Path(run.cfg.run_dir)) / f"step_{run.step:06d}"
    await run.trainer.save_checkpoint.call(str(path))
    progress = {"step": run.step, "version": run.version, "next_seed": run.next_seed, "path": str(path)}
    latest = checkpoint_dir(Path(run.cfg.run_dir)) / "latest.json"
    latest.with_suffix(".tmp").write_text(json.dumps(progress))
    latest.with_suffix(".tmp").replace(latest)  # atomic: a crash never leaves a half-written pointer


async def resume(run: Run) -> None:
    latest = checkpoint_dir(Path(run.cfg.run_dir)) / "latest.json"
    if not latest.exists():
        raise SystemExit(f"resume=true but {latest} does not exist: no checkpoint to resume from")
    progress = json.loads(latest.read_text())
    restored = (await run.trainer.load_checkpoint.call(progress["path"])).item(procs=0)
    run.step, run.version, run.next_seed = progress["step"], restored["policy_version"], progress["next_seed"]
    await run.trainer.push_weights.call(run.version)
    await run.policy.fanout("update_weights", run.version)
    logger.info("resumed at step %d, policy version %d", run.step, run.version)


# ---------------------------------------------------------------------------------------------------
# Set-up and tear-down


def prepare_model(cfg: RunConfig) -> str:
    """A local HF directory for both engines: the tiny model built from its seed, or a downloaded/local model."""
    if cfg.model.path is None:
        from forge_rl.tiny_model import build_tiny_model

        return str(build_tiny_model(Path(cfg.run_dir) / "tiny_model", seed=cfg.model.tiny_seed))
    if Path(cfg.model.path).is_dir():
        return cfg.model.path
    from huggingface_hub import snapshot_download

    return snapshot_download(cfg.model.path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


def load_app_module(name: str, constrained: bool):
    """The config's app_module, checked for the functions training calls (a one-line error if not)."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise SystemExit(f"config error: app_module {name!r} cannot be imported: {e}") from None
    needed = (["run_agent"] if hasattr(module, "run_agent") else ["render_prompt", "parse_action", "reward"]) + (["ACTIONS"] if constrained else [])
    missing = [n for n in needed if not hasattr(module, n)]
    if missing:
        raise SystemExit(f"config error: app_module {name!r} lacks {', '.join(missing)}")
    return module


async def start(cfg: RunConfig, game, url: str) -> Run:
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    allowed = answer_token_ids(game, tokenizer) if cfg.sampling.constrained else None
    gpus = torch.cuda.is_available()
    await store.start()
    policy, trainer, buffer, reference = await asyncio.gather(
        Generator.options(procs=cfg.generator.procs, with_gpus=gpus, num_replicas=cfg.generator.num_replicas).as_service(
            model_path, cfg.model.dtype, cfg.generator, cfg.seed
        ),
        Trainer.options(procs=cfg.trainer.procs, with_gpus=gpus).as_actor(
            model_path, cfg.grpo, cfg.trainer.optimizer, cfg.trainer.max_steps, cfg.model.dtype,
            micro_batch_size=cfg.trainer.micro_batch_size, allowed_token_ids=allowed,
        ),
        ReplayBufferActor.options().as_actor(
            cfg.grpo.batch_size, cfg.grpo.max_policy_age, filter_zero_spread=cfg.grpo.filter_zero_spread
        ),
        _maybe_reference(cfg, model_path, gpus, allowed),
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
        next_seed=cfg.seed * 1_000_000,
    )

    async def catch_up(replica):  # a restarted generator starts from the model directory: give it the current weights
        if run.version:
            await replica.actor.update_weights.call(run.version)

    policy.after_restart = catch_up
    return run


async def _maybe_reference(cfg: RunConfig, model_path: str, gpus: bool, allowed: list[int] | None):
    if cfg.grpo.kl_coef <= 0:
        return None
    return await ReferenceModel.options(num_replicas=cfg.reference.num_replicas, with_gpus=gpus).as_service(
        model_path, cfg.model.dtype, allowed_token_ids=allowed
    )


async def shutdown(run: Run | None) -> None:
    """Stop every actor and its processes (also on Ctrl-C), so no process outlives the run."""
    if run is None:
        await store.stop()
        return
    for task in (run.policy.stop(), stop(run.trainer), stop(run.buffer), run.reference.stop() if run.reference else None):
        if task is not None:
            try:
                await task
            except Exception as e:
                logger.warning("while shutting down: %s", e)
    if run.chat_server is not None:
        from forge_rl.agents import stop_chat_server

        await stop_chat_server(run)
    await store.stop()
    await run.sessions.close()
    run.metrics.close()


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
    dump(cfg, run_dir / "config.yaml")  # the resolved config, to reproduce the run
    url, local_server = env_url(cfg.env.url, cfg.env.server, cfg.env.max_concurrent)
    run = None
    try:
        run = await start(cfg, game, url)
        if cfg.resume:
            await resume(run)
        if cfg.eval.interval:
            run.references = await evaluate_references(run)
            run.metrics.log(run.step, run.references)
            print("reference policies on the evaluation deals:", {k.split("/")[-1]: round(v, 3) for k, v in run.references.items()})
        progress = tqdm(total=cfg.trainer.max_steps, initial=run.step, desc=f"GRPO {cfg.app_module}", dynamic_ncols=True)
        workers = [] if cfg.synchronous else [asyncio.create_task(rollout_worker(run)) for _ in range(cfg.rollout.num_workers)]
        try:
            await train(run, progress, workers)
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
            curve = plot_curves(
                run_dir,
                {"train/reward": "training reward", "eval/ev": "eval EV (greedy)", "eval/ev_luck_corrected": "eval EV, luck-corrected"},
                labels,
            )
            print(f"learning curve: {curve}", file=sys.stderr)
        await shutdown(run)
        if local_server is not None:
            local_server.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_cli()
    # SIGTERM (kubectl delete, timeout, a scheduler) stops the run like Ctrl-C: actors and engine processes
    # shut down. Left to its default it would kill this process alone and orphan vLLM's engine processes.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        asyncio.run(main(config))
    except KeyboardInterrupt:
        print("interrupted: actors stopped, checkpoints kept in", Path(config.run_dir) / "checkpoints", file=sys.stderr)
        sys.exit(130)
