"""The GRPO loop every app shares: set-up, the rollout and training loops, tear-down.

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

Playing one game and one group is forge_rl/play.py (one game is one episode: what the policy sampled
is kept as sampled, each new observation tokenized alone and appended), evaluation forge_rl/evaluation.py,
checkpoints forge_rl/checkpoint.py. The prompt, the parsing of the answer and the reward are the three
functions of the config's `app_module` (apps/blackjack/game.py); nothing here knows the rules of any
game, so another OpenEnv environment trains with these files unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # a run's own process: skip openenv's gradio import (3-4 s), as the servers do
    sys.modules.setdefault("gradio", None)  # (forge_rl/envs/__main__.py); openenv catches the ImportError

from forge_rl import faults, store, weight_sync
from forge_rl.actor import call, start_all, stop
from forge_rl.batching import RequestBatcher
from forge_rl.checkpoint import resume, save_checkpoint
from forge_rl.config import ConfigError, RunConfig, dump, parse_cli
from forge_rl.envs import load_env_class
from forge_rl.envs.client import env_url
from forge_rl.evaluation import evaluate, evaluate_references, figures
from forge_rl.generator import Generator
from forge_rl.metrics import MetricsLogger, plot_curves
from forge_rl.play import EnvironmentLost, SessionPool, answer_token_ids, play_group
from forge_rl.provisioner import get_provisioner
from forge_rl.reference import ReferenceModel
from forge_rl.replay_buffer import ReplayBufferActor
from forge_rl.self_imitation import ImitationPool
from forge_rl.trainer import Trainer
from forge_rl.types import Completion, Episode

logger = logging.getLogger("forge_rl.grpo")
BUFFER_TIMEOUT_S = 60.0  # per call to the replay buffer actor (every endpoint returns at once)
EXIT_GRACE_S = 60.0  # the longest the interpreter may take to exit after the run has stopped
STALL_WARNING_S = 60.0  # a training loop without a step for this long says what it waits for


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

    imitation: ImitationPool | None = None  # grpo.self_imitation: past best episodes trained on again
    batcher: RequestBatcher | None = None  # the games' requests, sent together (forge_rl/batching.py)

    async def generate(self, prompt_ids: list[int], params: dict) -> list[Completion]:
        """One request to the policy service, sent with those of the other games in flight in one call
        to whichever generator replica it routes to."""
        if self.batcher is None:
            send = lambda requests: self.policy.route("generate_batch", requests)  # noqa: E731
            self.batcher = RequestBatcher(send, max_in_flight=len(self.policy.replicas))
        return await self.batcher.generate(prompt_ids, params)


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
    """Train on `batch` (and, with self-imitation, on past best episodes), then make every generator
    serve the new weights (version v+1)."""
    clock = time.perf_counter()
    ref_logprobs, imitate = None, None
    if run.reference is not None:
        ref_logprobs = await run.reference.route("logprobs", [e.tokens for e in batch])
    if run.imitation is not None:
        run.imitation.add_batch(batch)
        imitate = run.imitation.sample(run.cfg.grpo.self_imitation.episodes)
    timeout_s = run.cfg.trainer.timeout_s
    metrics = await call(run.trainer, "train_step", batch, ref_logprobs, imitate, timeout_s=timeout_s)
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
        if run.imitation is not None:  # grpo.self_imitation: the pool, and the NLL of what was replayed
            values.update({"train/imitation_pool": len(run.imitation), "train/imitation_nll": metrics.get("imitation_nll", float("nan"))})
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
        imitation=ImitationPool(cfg.grpo.self_imitation.capacity, cfg.seed) if cfg.grpo.self_imitation.episodes else None,
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

