"""The GRPO loops: rollout workers filling the replay buffer, and the training loop emptying it.

    rollout workers --Rollouts.group(seed)--> replay buffer --batch--> Learner.step --> weights v+1 out
                                                                        (eval, checkpoint, metrics)

Rollout workers never wait for training; the buffer drops what grows too stale. The training loop waits only
for a batch. `synchronous: true` instead alternates: collect a batch with the current weights, then train.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from forge_rl.core.config import RunConfig
from forge_rl.recipes.grpo.checkpoint import save_checkpoint
from forge_rl.recipes.grpo.learner import Learner
from forge_rl.recipes.grpo.state import RunState
from forge_rl.recipes.metrics import MetricsLogger, sample_line
from forge_rl.rollout.evaluation import Evaluation, figures
from forge_rl.rollout.rollouts import Rollouts, gather_or_cancel
from forge_rl.runtime.actor import call

logger = logging.getLogger(__name__)
BUFFER_TIMEOUT_S = 60.0  # per call to the replay buffer actor (every endpoint returns at once)
STALL_WARNING_S = 60.0  # a training loop without a step for this long says what it waits for


class InFlight:
    """The staleness bound where data is produced: once the oldest group in flight is `max_age` versions behind,
    no new group starts until it ends, so a slowed machine finishes old groups instead of starting ever more."""

    def __init__(self, max_age: int):
        self.max_age, self.started = max(max_age, 1), Counter()  # 0 would play one group at a time
        self.waits = 0  # times a worker began waiting for an old group to end (not how often it asked)
        self.admission = asyncio.Lock()  # held by the rollout worker deciding whether to start a group
        self._waiting: set = set()  # the workers waiting now

    def admits(self, version: int, worker=None) -> bool:
        """Whether `worker` may start a group under `version`; a worker turned away again while it waits
        is the same wait."""
        admitted = not self.started or version - min(self.started) < self.max_age
        if admitted:
            self._waiting.discard(worker)
        elif worker not in self._waiting:
            self._waiting.add(worker)
            self.waits += 1
        return admitted

    def start(self, version: int) -> None:
        self.started[version] += 1

    def end(self, version: int) -> None:
        self.started[version] -= 1
        if not self.started[version]:
            del self.started[version]

    def __len__(self) -> int:
        return sum(self.started.values())


@dataclass
class Job:
    """A run's components, wired by main.py `start`. Each owns its own state; the loops only call them."""

    cfg: RunConfig
    state: RunState
    rollouts: Rollouts
    learner: Learner
    evaluation: Evaluation
    buffer: object  # ReplayBufferActor
    metrics: MetricsLogger
    stopping: asyncio.Event
    in_flight: InFlight | None = None  # asynchronous mode: the groups being played (rollout_worker)

    async def buffer_stats(self) -> dict:
        return await call(self.buffer, "stats", timeout_s=BUFFER_TIMEOUT_S)


async def rollout_worker(job: Job) -> None:
    """Waits while the groups held and in flight make the next batch: more would only go stale while taking the
    trainer's CPU. A game's error loses its group; any other error stops the run.
    """
    while not job.stopping.is_set():
        async with job.in_flight.admission:  # one worker decides at a time, or all would see room for one more
            busy = len(job.in_flight)  # read before the buffer: a group ending meanwhile is counted, not missed
            room = (await job.buffer_stats())["groups"] + busy < job.cfg.grpo.batch_size
            version = job.state.version
            if admitted := room and job.in_flight.admits(version, worker=asyncio.current_task()):
                seed, job.state.next_seed = job.state.next_seed, job.state.next_seed + 1
                job.in_flight.start(version)
        if not admitted:
            await asyncio.sleep(0.05)
            continue
        try:
            group = await job.rollouts.group(seed)
            if group:
                await call(job.buffer, "add", group, timeout_s=BUFFER_TIMEOUT_S)
        finally:
            job.in_flight.end(version)


async def collect_synchronously(job: Job, filtered_at_step: int) -> list:
    """Exactly the groups a batch needs, on consecutive seeds, at most rollout.num_workers at once; a lost or
    refused group is replaced in a next round. Groups enter in seed order: the same batch whatever the timing."""
    cfg, state, kept = job.cfg, job.state, 0
    workers = asyncio.Semaphore(cfg.rollout.num_workers)  # FIFO: the seeds start in order

    async def group(seed: int):
        async with workers:
            return await job.rollouts.group(seed)

    waiting_since = time.time()
    while kept < cfg.grpo.batch_size:
        seeds = range(state.next_seed, state.next_seed + cfg.grpo.batch_size - kept)
        state.next_seed = seeds.stop
        groups = [g for g in await gather_or_cancel(group(s) for s in seeds) if g]
        kept += sum(await call(job.buffer, "add_groups", groups, timeout_s=BUFFER_TIMEOUT_S))
        await check_groups_have_spread(job, filtered_at_step)
        waiting_since = await warn_if_stalled(job, waiting_since)
    return await call(job.buffer, "sample", state.version, timeout_s=BUFFER_TIMEOUT_S)


async def next_batch(job: Job, workers: list[asyncio.Task], filtered_at_step: int) -> list:
    """The next batch the rollout workers filled the buffer with (asynchronous mode)."""
    waiting_since = time.time()
    while (batch := await call(job.buffer, "sample", job.state.version, timeout_s=BUFFER_TIMEOUT_S)) is None:
        await check_groups_have_spread(job, filtered_at_step)
        for worker in workers:
            if worker.done() and not worker.cancelled() and worker.exception():
                raise RuntimeError("a rollout worker stopped; no more data is coming") from worker.exception()
        waiting_since = await warn_if_stalled(job, waiting_since)
        await asyncio.sleep(0.05)
    return batch


async def check_groups_have_spread(job: Job, filtered_at_step: int) -> None:
    """Fail loud instead of sampling forever: with DAPO's filter, groups all scoring alike may never fill a batch."""
    filtered = (await job.buffer_stats())["filtered_zero_spread"] - filtered_at_step
    if filtered > 50 * job.cfg.grpo.batch_size:
        raise RuntimeError(
            f"{filtered} groups since the last train step were refused for equal rewards (grpo.filter_zero_spread): every game "
            "of a group scored alike, from a policy near determinism or tasks all solved or all failed. Raise "
            "grpo.entropy_coef or grpo.group_size, lower trainer.optimizer.lr, or set grpo.filter_zero_spread=false"
        )


async def warn_if_stalled(job: Job, since: float) -> float:
    """Every STALL_WARNING_S without a train step, say what the loop waits for; returns when it last
    said so (or `since`)."""
    if time.time() - since < STALL_WARNING_S:
        return since
    stats, rollouts = await job.buffer_stats(), job.rollouts
    logger.warning(
        "no train step for %.0f s: the replay buffer holds %d of the %d groups a step needs (groups added %d, "
        "refused for equal rewards %d, evicted as older than max_policy_age %d; games played %d; groups lost %s)",
        time.time() - since, stats["groups"], job.cfg.grpo.batch_size, stats["added"], stats["filtered_zero_spread"],
        stats["evicted_stale"], rollouts.episodes_played, dict(rollouts.lost_groups),
    )
    return time.time()


def log_eval_samples(job: Job, step: int, write) -> None:
    """The last evaluation's samples to the metrics, and the first on the console (`write`)."""
    job.metrics.log_samples(step, "eval", job.evaluation.samples)
    if job.evaluation.samples:
        write(sample_line(job.evaluation.samples[0]))


class StepsBar(tqdm):
    """The console's bar over train steps. Its estimate leaves out this process's first step, whose warm-up
    takes many times a later step; it reads '?' until the second step."""

    warm = False

    def update(self, n: float = 1) -> bool | None:
        if self.warm:
            return super().update(n)
        self.warm, start, step = True, self.start_t, self.n + n
        self.reset()  # a new clock for the rate, then the steps and start time put back
        self.start_t, self.n, self.last_print_n, self.initial = start, step, step, step
        self.refresh()
        return True


async def train(job: Job, progress, workers: list[asyncio.Task]) -> None:
    """The training loop: batch -> step -> weights out -> (eval, checkpoint) until max_steps."""
    cfg, state, rollouts = job.cfg, job.state, job.rollouts
    start, episodes_at_start = time.time(), rollouts.episodes_played
    while state.step < cfg.trainer.max_steps:
        filtered_at_step, waiting = (await job.buffer_stats())["filtered_zero_spread"], time.perf_counter()
        if cfg.synchronous:
            batch = await collect_synchronously(job, filtered_at_step)
        else:
            batch = await next_batch(job, workers, filtered_at_step)
        collected = time.perf_counter() - waiting  # synchronous: the batch's generation; else what is left of it
        values = await job.learner.step(batch, state.version + 1)
        values["time/collect_s"] = collected
        state.version, state.step = state.version + 1, state.step + 1
        reward, invalid_rate = rollouts.recent_figures()
        values.update({
            "train/reward": reward,
            "train/invalid_rate": invalid_rate,
            "train/episodes_per_s": (rollouts.episodes_played - episodes_at_start) / (time.time() - start),
            "rollout/prompt_overflows": rollouts.prompt_overflows,
            **{f"rollout/lost_groups/{reason}": n for reason, n in rollouts.lost_groups.items()},
            "rollout/env_s": rollouts.env_s,  # totals over the run's games: what share of a game was the environment's
            "rollout/policy_s": rollouts.policy_s,
        })
        if job.in_flight is not None:
            values.update({"rollout/groups_in_flight": len(job.in_flight), "rollout/admission_waits": job.in_flight.waits})
        values.update({f"buffer/{k}": v for k, v in (await job.buffer_stats()).items()})
        if cfg.logging.samples_every and state.step % cfg.logging.samples_every == 0:
            job.metrics.log_samples(state.step, "train", rollouts.samples(rollouts.last_group))
        if cfg.eval.interval and (state.step % cfg.eval.interval == 0 or state.step == cfg.trainer.max_steps):  # and the final policy
            values.update(await job.evaluation())
            progress.write(f"step {state.step} {figures(job.evaluation.last)}  |  reference: {figures(job.evaluation.references) or 'none'}")
            log_eval_samples(job, state.step, progress.write)
        if cfg.trainer.checkpoint_every and (state.step % cfg.trainer.checkpoint_every == 0 or state.step == cfg.trainer.max_steps):
            # and at the end, so that a run can be continued with more steps
            values.update(await save_checkpoint(job.learner.trainer, cfg.run_dir, state, cfg.trainer.timeout_s))
        job.metrics.log(state.step, values)
        progress.update(1)
        # The app's headline figures; one named like the bar's own (eval/reward) gets an eval_ prefix.
        postfix = {"reward": f"{reward:+.3f}"}
        for key, value in list(job.evaluation.last.items())[:2]:
            name = key.split("/")[-1]
            postfix["eval_" + name if name in ("reward", "eps") else name] = f"{value:+.3f}"
        progress.set_postfix(postfix | {"eps": f"{values['train/episodes_per_s']:.1f}/s"})
