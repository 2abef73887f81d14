"""The GRPO recipe's set-up and tear-down: `python -m forge_rl.grpo --config FILE [dotted.key=value ...]`.

    start(): model directory, tokenizer, app -> where the roles run, how weights travel -> TorchStore and the
             actor meshes (policy service, trainer, replay buffer, reference) -> Rollouts, Learner, Evaluation
    main():  resume or not, the reference policies, the rollout workers and the training loop (loop.py)
    shutdown(): every actor and process stopped, also on Ctrl-C and on failure

An app is only its module (the config's `app_module`, e.g. apps/blackjack/task.py); nothing here knows
the rules of any game.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from forge_rl.buffer.replay_buffer import ReplayBufferActor
from forge_rl.core.app import App
from forge_rl.core.config import ConfigError, RunConfig, dump, parse_cli
from forge_rl.core.objective import GRPOLoss
from forge_rl.engines.vllm.generator import Generator, catch_up
from forge_rl.envs.local import env_url
from forge_rl.envs.rows import server_variables
from forge_rl.models import resolve_model
from forge_rl.recipes.grpo import faults
from forge_rl.recipes.grpo.check import check_run
from forge_rl.recipes.grpo.checkpoint import resume
from forge_rl.recipes.grpo.learner import Learner
from forge_rl.recipes.grpo.loop import InFlight, Job, StepsBar, log_eval_samples, rollout_worker, train
from forge_rl.recipes.grpo.state import RunState
from forge_rl.recipes.metrics import MetricsLogger, plot_curves
from forge_rl.rollout.evaluation import Evaluation, figures
from forge_rl.rollout.play import answer_token_ids
from forge_rl.rollout.rollouts import Rollouts
from forge_rl.rollout.sessions import check_reset_args, fit_sessions_to_server, task_split_sizes
from forge_rl.rollout.tools import with_tools
from forge_rl.runtime.actor import call, start_all, stop
from forge_rl.runtime.provisioner import get_provisioner
from forge_rl.weights import broadcast, control, shm
from forge_rl.weights.plan import plan

logger = logging.getLogger("forge_rl.grpo")
EXIT_GRACE_S = 60.0  # the longest the interpreter may take to exit after the run has stopped


async def start(cfg: RunConfig, app: App, url: str, checked=None) -> Job:
    """Every component of the run, started and wired; one that fails to start stops the others. The policy's
    engine, the longest to start, goes first, while `checked` (`environment`) checks the environment."""
    model_path = resolve_model(cfg.model.path, cfg.model.dtype, Path(cfg.run_dir) / "tiny_model", cfg.model.tiny_seed)
    hosts = {"trainer": cfg.trainer.hosts, "generator": cfg.generator.hosts}
    with_reference = cfg.grpo.kl_coef > 0 and cfg.trainer.lora is None  # under LoRA the trainer's base model is it
    if with_reference:
        hosts["reference"] = cfg.reference.hosts
    provisioner = get_provisioner()
    await provisioner.use_cluster(cfg.cluster, hosts)  # a no-op unless cluster.workers/kubernetes is set
    gpus = provisioner.has_gpus()  # this host's, or the workers' (a controller pod may have none)
    weights_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    generator_hosts = [provisioner.host_of("generator", i, cfg.generator.hosts) for i in range(cfg.generator.num_replicas)]
    try:  # by where trainer rank 0 and each replica will run
        sync = await plan(cfg.generator.weight_sync, provisioner.host_of("trainer"), generator_hosts, weights_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    logger.info("weight sync: %s (generator.weight_sync: %s)", sync.kind, cfg.generator.weight_sync)
    launching_policy = asyncio.ensure_future(Generator.replicas(cfg.generator, gpus, hosts=cfg.generator.hosts, role="generator").as_service(
        # LoRA adapters are added to each layer's output in Python, which a CUDA-graph replay skips
        model_path, cfg.model.dtype, dataclasses.replace(cfg.generator, eager=True) if cfg.trainer.lora else cfg.generator, cfg.seed
    ))
    def load_tokenizer():  # and the trainer's modules (torchtitan imports for seconds): on a thread, the loop launching the policy
        import forge_rl.engines.titan.reference, forge_rl.engines.titan.trainer  # noqa: F401, E401
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)

    try:
        tokenizer = await asyncio.to_thread(load_tokenizer)
        allowed = answer_token_ids(app, tokenizer) if cfg.sampling.constrained else None
    except BaseException as e:  # the policy started meanwhile is stopped
        await start_all(launching_policy, _raise(e))
    from forge_rl.engines.titan.reference import ReferenceModel
    from forge_rl.engines.titan.trainer import Trainer

    # The trainer and the reference score by the generator's sampling distribution.
    scoring = {"allowed_token_ids": allowed, "temperature": cfg.sampling.temperature, "micro_batch_size": cfg.trainer.micro_batch_size}
    policy, trainer, buffer, reference, _, (cfg, app, num_tasks) = await start_all(
        launching_policy,
        Trainer.options(procs=cfg.trainer.procs, with_gpus=gpus, hosts=cfg.trainer.hosts, role="trainer").as_actor(
            model_path, GRPOLoss(cfg.grpo, cfg.sampling.max_tokens), cfg.trainer.optimizer, optimizer_steps(cfg), cfg.model.dtype,
            weight_sync=sync.kind, lora=cfg.trainer.lora, **scoring,
        ),
        ReplayBufferActor.options().as_actor(  # synchronous: on-policy, no group of an older version is kept
            cfg.grpo.batch_size, 0 if cfg.synchronous else cfg.grpo.max_policy_age, filter_zero_spread=cfg.grpo.filter_zero_spread
        ),
        ReferenceModel.options(
            num_replicas=cfg.reference.num_replicas, with_gpus=gpus, hosts=cfg.reference.hosts, role="reference"
        ).as_service(model_path, cfg.model.dtype, **scoring) if with_reference else _ready(),
        control.start(),
        checked or _ready((cfg, app, {})),
    )
    # A restarted generator loads the current weights before taking calls.
    policy.after_restart = catch_up
    if sync.kind == "broadcast":
        replicas = [r.actor for r in policy.replicas]
        ports = await broadcast.free_ports(sync.trainer_host, len(replicas))
        await broadcast.connect(trainer, replicas, cfg.generator.procs, sync.rendezvous, sync.binds, ports)
        policy.after_restart = functools.partial(
            broadcast.rejoin, trainer=trainer, procs=cfg.generator.procs, rendezvous=sync.rendezvous, binds=sync.binds, trainer_host=sync.trainer_host
        )
    rollouts = Rollouts(cfg, app, tokenizer, policy, url, allowed)
    rollouts.num_tasks = num_tasks
    return Job(
        cfg=cfg,
        state=RunState(next_seed=cfg.seed * cfg.SEEDS_PER_RUN),
        rollouts=rollouts,
        learner=Learner(cfg, trainer, policy, reference),
        evaluation=Evaluation(rollouts),
        buffer=buffer,
        metrics=MetricsLogger(Path(cfg.run_dir), cfg.logging, dataclasses.asdict(cfg)),  # W&B keeps the resolved config
        stopping=asyncio.Event(),
        in_flight=None if cfg.synchronous else InFlight(cfg.grpo.max_policy_age),
    )


async def environment(cfg: RunConfig, app: App, url: str, local_server) -> tuple:
    """(the config with the sessions the server accepts, the app with its tools, its task splits' sizes)."""
    if local_server is not None:
        await asyncio.to_thread(local_server.healthy)
    if cfg.env.url is not None:  # a running server: the session pool never holds more sessions than it accepts
        size = fit_sessions_to_server(url, cfg.env.max_concurrent, cfg.grpo.group_size, cfg.env.timeout_s, cfg.env.queue_sessions)
        cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_concurrent=size))
    num_tasks = task_split_sizes(url, cfg)  # a split the server lacks stops the run, naming the key
    await check_reset_args(url, cfg)  # so do reset arguments it refuses
    return cfg, await with_tools(app, url, cfg.env.timeout_s), num_tasks  # MCP_TOOLS: the server's tools, listed once


def optimizer_steps(cfg: RunConfig) -> int:
    """The LR schedule's length: every batch takes grpo.epochs x grpo.minibatches optimizer steps."""
    return cfg.trainer.max_steps * cfg.grpo.epochs * cfg.grpo.minibatches


async def _ready(value=None):
    return value


async def _raise(error: BaseException):
    raise error


async def shutdown(job: Job | None) -> None:
    """Stop every actor and its processes, so no process outlives the run; on a cluster, name a host that died."""
    provisioner = get_provisioner()
    lost = [f"{h.worker} ({h.address}), which ran {', '.join(h.running.values()) or 'nothing'}" for h in await provisioner.lost_hosts()]
    if job is not None:
        learner = job.learner
        stops = (learner.policy.stop(), stop(learner.trainer), stop(job.buffer), learner.reference.stop() if learner.reference else None)
        for task in stops:
            if task is not None:
                try:
                    await task
                except Exception as e:
                    logger.warning("while shutting down: %s", e)
    await control.stop()
    shm.remove_orphaned_buffers()
    await provisioner.stop()
    if job is not None:
        await job.rollouts.close()
        job.metrics.close()
    for host in lost:
        print(f"forge_rl: lost host {host}. The run stopped; resume=true continues from its last checkpoint", file=sys.stderr)


async def main(cfg: RunConfig) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, print_task_stacks)
    run_dir = Path(cfg.run_dir)
    app = check_run(cfg)  # what `python -m forge_rl.config` checks; fails before anything starts
    dump(cfg, run_dir / "config.yaml")  # the resolved config, to reproduce the run
    print(f"logs of every process (vLLM, Monarch): {run_dir / 'run.log'}")
    try:
        dataset = cfg.env.dataset and server_variables(cfg.env.dataset, cfg.app_module, cfg.env.test_fraction, cfg.env.reward_timeout_s)
        url, local_server = env_url(cfg.env.url, cfg.env.server, cfg.env.max_concurrent, cfg.env.server_python, dataset, wait=False)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    job = None
    try:
        checked = environment(cfg, app, url, local_server)
        if local_server is None:  # a running server answers at once: what it refuses stops the run before any engine starts
            checked = _ready(await checked)
        job = await start(cfg, app, url, checked)
        cfg = job.cfg
        if cfg.resume:
            job.state = await resume(job.learner.trainer, cfg.run_dir, cfg.trainer.timeout_s)
            job.metrics.drop_after(job.state.step)  # the rows of steps after the checkpoint are logged again
            await job.learner.publish(job.state.version)
        if cfg.eval.interval:
            references = await job.evaluation.play_references()
            print(f"reference policies on the evaluation seeds: {figures(references) or 'none'}")
            if not cfg.resume:  # a resumed run's log has them already, and the untrained policy's figures
                untrained = await job.evaluation()
                job.metrics.log(job.state.step, {**references, **untrained})
                print(f"step 0 {figures(untrained)}")
                log_eval_samples(job, 0, print)
        state = job.state
        progress = StepsBar(total=cfg.trainer.max_steps, initial=state.step, desc=f"GRPO {cfg.app_module}", dynamic_ncols=True)
        workers = [] if cfg.synchronous else [asyncio.create_task(rollout_worker(job)) for _ in range(cfg.rollout.num_workers)]
        try:  # a dead trainer stops it within seconds
            await faults.watch_trainer(job.learner.trainer, cfg, state, train(job, progress, workers))
        finally:
            job.stopping.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            progress.close()
        final = run_dir / "final" / "hf"
        await call(job.learner.trainer, "export_hf", str(final), timeout_s=cfg.trainer.timeout_s)
        print(f"done: {state.step} steps, policy version {state.version}; the policy as an HF directory: {final}")
    finally:
        if job is not None and job.state.step:  # also after Ctrl-C: the curve of what was done
            first = job.evaluation.split_references[0].items()  # the first split's, as the headline
            labels = {f"{k} {v:+.3f} on the evaluation seeds": v for k, v in first}
            headline = {k: f"eval {k.split('/')[-1]} (greedy)" for k in list(job.evaluation.last)[:2]}
            curve = plot_curves(run_dir, {"train/reward": "training reward", **headline}, labels)
            print(f"learning curve: {curve}", file=sys.stderr)
        await shutdown(job)
        if local_server is not None:
            local_server.stop()


def console_to_log(run_dir: Path) -> Path:
    """Every process's output to run_dir/run.log, this process's sys.stdout/sys.stderr still on the console.

    Done on file descriptors 1 and 2, which actor and engine processes inherit; Python's own streams are
    re-opened on copies of the console's."""
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
    """End the process even if the interpreter's exit hangs: after a host was lost, a Monarch runtime thread
    was seen to keep the exit waiting."""

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


def run_from_command_line(config: RunConfig | None = None) -> None:
    """The run of `python -m forge_rl.grpo`: `config` already parsed there, else parsed here."""
    config = config or parse_cli()
    log_file = console_to_log(Path(config.run_dir))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM stops the run like Ctrl-C; its default would orphan vLLM's engine processes. SIGINT is restored
    # first: a run started in the background by a script inherits it ignored.
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
