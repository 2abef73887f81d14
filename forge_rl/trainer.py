"""Trainer: GRPO updates of the policy on TorchTitan, one Monarch actor mesh (FSDP2 over its ranks).

    replay buffer --batch of whole groups--> train_step --weights--> push_weights --> weight_sync --> generators

What it consumes: a flat list of Episodes holding whole groups (what ReplayBuffer.sample returns),
optionally with reference log-probs from ReferenceModel for the KL term. What it produces: one
optimizer step per call and a metrics dict; on push_weights, HF-named weights sent by the configured
transport (shared memory, broadcast or TorchStore) with the version's handle in TorchStore. It never waits for data: the training loop calls it when a batch exists.

Deliberately not here: sequence packing (sdpa has no block-causal mask; episodes are right-padded
per micro-batch instead), tensor/pipeline parallelism, activation checkpointing, torch.compile.
"""

import asyncio
import math
import socket
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from monarch.actor import endpoint
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import LRScheduler as TitanLRSchedulerConfig
from torchtitan.config import Optimizer as TitanOptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_

from forge_rl import store
from forge_rl.actor import ForgeActor
from forge_rl.config import GRPOConfig, OptimizerConfig
from forge_rl.loss import grpo_loss, rollout_advantages
from forge_rl.titan_model import (
    autocast,
    build_model,
    hf_weight_rows,
    hf_weights,
    init_distributed,
    logprobs_of,
    pad_right,
    sequence_logprobs,
)
from forge_rl.types import Episode
from forge_rl.weight_sync import (
    HEADER_BYTES,
    SharedBuffers,
    WeightsHandle,
    broadcast_send,
    copy_rows,
    join_group,
    make_layout,
    map_buffer,
)

# Metrics that are token-weighted means inside grpo_loss; summed * num_tokens across pieces.
_MEAN_METRICS = (
    "kl", "entropy", "ratio_mean", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "advantage_mean",
    "behaviour_kl", "is_masked_fraction",
)


class Trainer(ForgeActor):
    """The policy being trained: model, AdamW, LR schedule, step counter, last pushed version.

    Lifecycle: constructed with config only; `setup` (all ranks) joins the process group, builds
    the model from the HF directory and the optimizer; then any sequence of train_step /
    push_weights / logprobs / save_checkpoint / load_checkpoint, each called on ALL ranks.
    Invariant: every rank holds the same step count and applies the same update (each rank
    gets the whole batch, trains on its slice, FSDP sums the gradients).
    """

    def __init__(
        self,
        model_path: str,
        grpo: GRPOConfig = GRPOConfig(),
        optimizer: OptimizerConfig = OptimizerConfig(),
        max_steps: int = 100,  # LR schedule length: cosine/linear decay reach 0 here (and cosine rises after)
        dtype: str = "float32",  # compute dtype: float32 on CPU, bfloat16 on GPU
        micro_batch_size: int = 8,  # sequences per forward/backward on one rank
        allowed_token_ids: list[int] | None = None,  # the generator's sampling restriction, if any
        temperature: float = 1.0,  # the generator's sampling temperature (titan_model.sampling_logits)
        weight_sync: str = "store",  # how push_weights sends the bytes: shm | broadcast | store (weight_sync.py)
    ):
        self.model_path, self.grpo, self.optim_config = model_path, grpo, optimizer
        self.max_steps, self.dtype, self.micro_batch_size = max_steps, dtype, micro_batch_size
        self.allowed_token_ids, self.temperature = allowed_token_ids, temperature
        if weight_sync not in ("shm", "broadcast", "store"):
            raise ValueError(f"Trainer: weight_sync must be shm, broadcast or store, got {weight_sync!r}")
        self.weight_sync = weight_sync
        self.policy_version = 0  # the last version pushed (setup and load_checkpoint set it too)

    @endpoint
    async def setup(self) -> None:
        """All ranks. Process group, model (HF weights via the adapter), optimizer, LR schedule."""
        self.rank, self.world, self.device = init_distributed()
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // self.world))
        self.own_rows = False  # sharded, into shared memory, all ranks on its host: each rank writes its rows
        if self.world > 1 and self.weight_sync == "shm":
            hosts = [None] * self.world
            dist.all_gather_object(hosts, socket.gethostname())
            self.own_rows = len(set(hosts)) == 1
        self.model, self.adapter = build_model(self.model_path, self.device, self.dtype)
        self.model.train()
        o = self.optim_config
        titan_optim = TitanOptimizerConfig(
            name="AdamW",
            lr=o.lr,
            weight_decay=o.weight_decay,
            implementation="fused" if self.device.type == "cuda" else "foreach",
        )
        dims = ParallelDims(dp_replicate=1, dp_shard=self.world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=self.world)
        self.optimizers = build_optimizers([self.model], titan_optim, dims)
        # TorchTitan's warmup-stable-decay schedule. "constant" = no decay phase; its horizon is
        # made unreachable because TorchTitan's schedule fails past its last step.
        constant = o.schedule == "constant"
        schedule = TitanLRSchedulerConfig(
            warmup_steps=o.warmup_steps, decay_ratio=0.0 if constant else None, decay_type="linear" if constant else o.schedule
        )
        self.lr_schedulers = build_lr_schedulers(self.optimizers, schedule, 10**9 if constant else self.max_steps)
        self.step, self.policy_version = 0, 0
        self.shared_buffers = SharedBuffers()  # allocated on the first shm push
        self.weights_group, self.sending = None, None

    @endpoint
    async def train_step(
        self, batch: list[Episode], ref_logprobs: list[torch.Tensor] | None = None, imitate: list[Episode] | None = None
    ) -> dict[str, float]:
        """All ranks (every rank gets the whole batch; returns the same metrics). One optimizer step.

        batch: whole groups (advantages are computed here, per group_id, from the rewards).
        ref_logprobs: per episode [T] reference log-probs aligned with tokens; needed if kl_coef > 0.
        imitate: past best episodes (forge_rl/self_imitation.py) whose mean token NLL, times
        grpo.self_imitation.coef, joins the loss of the same optimizer step.
        """
        t = self._tensors(batch, ref_logprobs)
        # Normalise by the whole batch so that micro-batches and ranks add up to its gradient.
        if self.grpo.loss_agg == "token_mean":
            denominator = t["mask"].sum().clamp(min=1).item()
        else:
            denominator = (t["mask"].sum(-1) > 0).sum().clamp(min=1).item()

        sums, ratio_min, ratio_max = defaultdict(float), math.inf, -math.inf
        ages = range(self.grpo.max_policy_age + 1)  # the same keys on every rank
        by_age = {a: [math.inf, -math.inf] for a in ages}  # age -> [ratio min, ratio max]
        for piece, weight in self._micro_batches(len(batch)):
            loss, m = self._forward_loss(t, piece, weight, denominator, by_age)
            loss.backward()
            n = m["num_tokens"].item()
            sums["loss"] += loss.item()
            sums["num_tokens"] += n
            for k in _MEAN_METRICS:
                if k in m:
                    sums[k] += m[k].item() * n
            if n > 0:
                ratio_min, ratio_max = min(ratio_min, m["ratio_min"].item()), max(ratio_max, m["ratio_max"].item())

        imitation_nll = self._imitation_backward(imitate) if imitate else None

        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.optim_config.max_grad_norm)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        await self._broadcast_sent()  # the last push may still be sending these parameters
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.step += 1

        sums = self._all_sum(sums)
        n = max(sums.pop("num_tokens"), 1.0)
        metrics = {"loss": sums.pop("loss"), **{k: v / n for k, v in sums.items()}}
        metrics.update(
            ratio_min=-self._all_max(-ratio_min),
            ratio_max=self._all_max(ratio_max),
            grad_norm=grad_norm.item(),
            lr=lr,
            step=self.step,
            num_tokens=n,
            num_sequences=len(batch),
            reward_mean=sum(e.reward for e in batch) / len(batch),
            policy_version_min=min(e.policy_version for e in batch),
            mixed_version_episodes=sum(len(set(e.token_versions[e.loss_mask.bool()].tolist())) > 1 for e in batch)
            / len(batch),
        )
        if imitation_nll is not None:
            metrics.update(imitation_nll=imitation_nll, imitation_episodes=len(imitate))
        for a in ages:  # the trainer/behaviour ratio's extremes by the age of the token's version
            low, high = -self._all_max(-by_age[a][0]), self._all_max(by_age[a][1])
            if high >= low:
                metrics[f"ratio_min/age_{a}"], metrics[f"ratio_max/age_{a}"] = low, high
        return metrics

    @endpoint
    async def push_weights(self, version: int) -> int:
        """All ranks (collective when sharded). Rank 0 sends the HF-named weights by the weight_sync
        transport, each tensor gathered as its turn comes, and puts the version's handle in TorchStore
        (forge_rl/weight_sync.py); into shared memory, the ranks of a sharded trainer on one host each
        copy their own rows instead, with no gather. Returns once generators can fetch it (a broadcast is
        then under way and completes as they take it; the next push waits for it): the number of tensors
        on rank 0, 0 elsewhere."""
        shapes, tensors = (hf_weight_rows if self.own_rows else hf_weights)(self.model, self.adapter, self.dtype)
        try:
            if self.own_rows:
                await self._write_own_rows(shapes, tensors, version)
            elif self.rank == 0:
                await self._send_weights(shapes, tensors, version)
        finally:  # whatever failed on one rank: the others wait in its gathers and at the barrier
            await asyncio.to_thread(drain, tensors)
            if dist.is_initialized():
                dist.barrier()
        self.policy_version = version
        return len(shapes) if self.rank == 0 else 0

    async def _send_weights(self, shapes: dict[str, torch.Tensor], tensors: Iterator[torch.Tensor], version: int) -> None:
        """Rank 0: `tensors` (of `shapes`, in order) by the weight_sync transport, the version's handle
        into TorchStore."""
        if self.weight_sync == "shm":  # the handle goes in while the bytes are written; until they are,
            handle = self.shared_buffers.claim(shapes, version)  # a reader given it refuses the buffer
            written, put = await asyncio.gather(asyncio.to_thread(self.shared_buffers.fill, tensors, handle),
                                                store.put_handle(handle.as_dict(), version), return_exceptions=True)
            await settle_handle(version, written, put)
            return
        if self.weight_sync == "store":
            await store.put_state_dict(dict(zip(shapes, tensors, strict=True)), version)
            handle = WeightsHandle("store", version)
        else:
            if self.weights_group is None:
                raise RuntimeError("Trainer: weight_sync is broadcast but join_weights_group was never called")
            await self._broadcast_sent()  # one at a time, in version order
            tensors = list(tensors)  # sharded: gathered now; else the parameters themselves, which
            layout, nbytes = make_layout(shapes)  # train_step leaves alone until they are sent
            self.sending = asyncio.ensure_future(asyncio.to_thread(broadcast_send, self.weights_group, tensors))
            handle = WeightsHandle("broadcast", version, socket.gethostname(), layout=layout, nbytes=nbytes)
        await store.put_handle(handle.as_dict(), version)

    async def _write_own_rows(self, shapes: dict[str, torch.Tensor], rows: Iterator, version: int) -> None:
        """All ranks of a sharded trainer on the generators' host: each copies its own rows of each tensor
        into the shm buffer at once (`hf_weight_rows`: no gather), rank 0 also the tensors that must be
        gathered. Rank 0 locks the buffer before anyone writes and writes its header once all are done."""
        handle, payload, error = None, None, None
        if self.rank == 0:
            try:  # no room in /dev/shm, or readers still hold the buffer: nobody writes, the old version stays
                handle = self.shared_buffers.claim(shapes, version)
                payload = await asyncio.to_thread(self.shared_buffers.begin, handle)
            except Exception as e:
                error = e
        path = [handle.path if payload is not None else None]
        dist.broadcast_object_list(path, src=0)
        if path[0] is None:
            if error is not None:
                raise error
            return
        put = asyncio.ensure_future(store.put_handle(handle.as_dict(), version)) if self.rank == 0 else None
        if payload is None:
            payload = map_buffer(path[0])[HEADER_BYTES:]
        try:
            await asyncio.to_thread(copy_rows, payload, make_layout(shapes)[0], rows)
        except Exception as e:
            error = e
        await asyncio.to_thread(drain, rows)  # the gathers left, after a failure here
        written = torch.tensor([error is None], dtype=torch.int32, device=self.device)
        dist.all_reduce(written, op=dist.ReduceOp.MIN)  # every rank's rows are in
        if error is None and not written:
            error = RuntimeError(f"weight version {version}: another trainer rank failed to write its rows into the buffer")
        if self.rank == 0:
            self.shared_buffers.end(handle, written=error is None)
            (put,) = await asyncio.gather(put, return_exceptions=True)
            await settle_handle(version, error, put)
        elif error is not None:
            raise error

    async def _broadcast_sent(self) -> None:
        """Wait until the generators have taken the last broadcast (it may still read the parameters)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            await sending

    @endpoint
    async def join_weights_group(self, rendezvous: str, port: int, world: int, bind: str) -> None:
        """All ranks, with every generator's join at the same time: rank 0 joins the broadcast group as
        its rank 0 and hosts its rendezvous on `rendezvous:port`; other ranks do nothing."""
        if self.rank == 0:
            self.weights_group = await asyncio.to_thread(join_group, rendezvous, port, 0, world, bind)

    @endpoint
    async def logprobs(self, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """All ranks (collective when sharded; all return the same). Current policy's per-token
        log-probs, each [T] aligned with its ids (position 0 is 0)."""
        self.model.eval()
        try:
            return logprobs_of(
                self.model, token_ids, self.device, self.dtype, self.micro_batch_size, self.allowed_token_ids, self.temperature
            )
        finally:
            self.model.train()

    @endpoint
    async def save_checkpoint(self, path: str) -> None:
        """All ranks. Model, optimizer, LR schedule, step and policy version with
        torch.distributed.checkpoint (each rank writes its shards)."""
        dcp.save(self._checkpoint_state(), checkpoint_id=path)

    @endpoint
    async def load_checkpoint(self, path: str) -> dict[str, int]:
        """All ranks. Restore what save_checkpoint wrote (any earlier number of ranks works for the
        model and optimizer); training then continues with the same numbers."""
        await self._broadcast_sent()
        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"])
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        self._apply_schedule()
        self.step, self.policy_version = int(state["progress"]["step"]), int(state["progress"]["policy_version"])
        return {"step": self.step, "policy_version": self.policy_version}

    async def __cleanup__(self, exc: Exception | None) -> None:
        """Unlink the shared-memory buffers (after a kill -9, Generator cleanup removes them instead)."""
        if hasattr(self, "shared_buffers"):
            self.shared_buffers.close()

    # ------------------------------------------------------------------------ helpers

    def _checkpoint_state(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "progress": {"step": self.step, "policy_version": self.policy_version},
        }

    def _apply_schedule(self) -> None:
        """Set the optimizer's lr to this run's schedule at the restored step. The checkpoint holds the lr
        of the run that saved it (0 at the end of a decayed schedule): a run resumed with more max_steps
        would take its first step at that lr."""
        for scheduler in self.lr_schedulers.schedulers:
            lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs

    def _tensors(self, batch: list[Episode], ref_logprobs) -> dict[str, torch.Tensor]:
        """Episodes -> right-padded [B, T] CPU tensors, lengths [B], and advantages [B]
        computed per group (group_id) from the rewards."""
        if not batch:
            raise ValueError("train_step: empty batch")
        if self.grpo.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("train_step: grpo.kl_coef > 0 needs ref_logprobs (ReferenceModel.logprobs of the batch)")
        length = max(len(e.tokens) for e in batch)

        def pad(rows, dtype):
            return pad_right([torch.as_tensor(r, dtype=dtype) for r in rows], length)

        t = {
            "tokens": pad([e.tokens for e in batch], torch.long),
            "lengths": torch.tensor([len(e.tokens) for e in batch]),
            "mask": pad([e.loss_mask for e in batch], torch.float32),
            "behaviour": pad([e.behaviour_logprobs for e in batch], torch.float32),
            "ages": self.policy_version - pad([e.token_versions for e in batch], torch.long),
            "advantages": torch.zeros(len(batch)),
        }
        t["mask"][:, 0] = 0  # the first token has no prediction to train
        if self.grpo.max_token_age is not None:  # tokens sampled too many versions ago leave the loss
            t["mask"] *= (t["ages"] <= self.grpo.max_token_age).float()
        if ref_logprobs is not None:
            t["ref"] = pad(ref_logprobs, torch.float32)
        by_group = defaultdict(list)
        for i, e in enumerate(batch):
            by_group[e.group_id].append(i)
        for rows in by_group.values():
            rewards = torch.tensor([float(batch[i].reward) for i in rows])
            rollouts = {}  # a rollout's segments (same rollout_id) count once; "" is an episode of its own
            index = torch.tensor([rollouts.setdefault(batch[i].rollout_id or -i - 1, len(rollouts)) for i in rows])
            t["advantages"][rows] = rollout_advantages(rewards, index, self.grpo.normalize_std, self.grpo.normalize_mean)
        return t

    def _forward_loss(self, t: dict, rows: torch.Tensor, weight: float, denominator: float, by_age: dict):
        """GRPO loss of some rows, trimmed to their longest episode; position 0 is dropped
        (nothing predicts it). Updates `by_age` (age -> [min, max] trainer/behaviour ratio)."""
        length = max(2, int(t["lengths"][rows].max()))

        def take(name):
            return t[name][rows, 1:length].to(self.device) if name in t else None

        with autocast(self.device, self.dtype):
            lp, logits = sequence_logprobs(
                self.model, t["tokens"][rows, :length].to(self.device), True, self.allowed_token_ids, self.temperature
            )
        mask = take("mask") * weight
        with torch.no_grad():
            ratio, ages = torch.exp(lp[:, 1:] - take("behaviour")), take("ages")
            for a, extremes in by_age.items():
                r = ratio[(ages == a) & mask.bool()]
                if r.numel():
                    extremes[0], extremes[1] = min(extremes[0], r.min().item()), max(extremes[1], r.max().item())
        return grpo_loss(
            lp[:, 1:],
            take("behaviour"),
            t["advantages"][rows].to(self.device),
            mask,
            self.grpo,
            ref_logprobs=take("ref"),
            logits=logits,
            denominator=denominator,
        )

    def _imitation_backward(self, episodes: list[Episode]) -> float:
        """Backward of coef x the mean NLL of the episodes' sampled tokens (their loss_mask); returns that NLL.
        Micro-batched and split over ranks as the GRPO loss is."""
        length = max(len(e.tokens) for e in episodes)
        tokens = pad_right([torch.as_tensor(e.tokens, dtype=torch.long) for e in episodes], length)
        mask = pad_right([torch.as_tensor(e.loss_mask, dtype=torch.float32) for e in episodes], length)
        mask[:, 0] = 0  # the first token has no prediction to train
        lengths = torch.tensor([len(e.tokens) for e in episodes])
        denominator = mask.sum().clamp(min=1).item()
        nll = 0.0
        for piece, weight in self._micro_batches(len(episodes)):
            end = max(2, int(lengths[piece].max()))
            with autocast(self.device, self.dtype):
                lp, _ = sequence_logprobs(
                    self.model, tokens[piece, :end].to(self.device), False, self.allowed_token_ids, self.temperature
                )
            piece_nll = -(lp[:, 1:] * mask[piece, 1:end].to(self.device)).sum() * weight / denominator
            (self.grpo.self_imitation.coef * piece_nll).backward()
            nll += piece_nll.item()
        return self._all_sum({"nll": nll})["nll"]

    def _micro_batches(self, n: int):
        """This rank's rows of a batch of n, as (rows, loss weight) micro-batches. Every rank runs the same
        number of forward/backward passes (FSDP's collectives pair up); a rank short of rows runs row 0
        with its loss weighted 0."""
        rows = self._my_rows(n)
        n_micro = max(1, int(self._all_max(math.ceil(len(rows) / self.micro_batch_size))))
        for piece in torch.tensor_split(rows, n_micro):
            yield (piece, 1.0) if len(piece) else (torch.tensor([0]), 0.0)

    def _my_rows(self, n: int) -> torch.Tensor:
        """This rank's contiguous slice of the batch's rows (sizes differ by at most one)."""
        return torch.tensor_split(torch.arange(n), self.world)[self.rank]

    def _all_max(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([float(x)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def _all_sum(self, sums: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return dict(sums)
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))


async def settle_handle(version: int, written, put) -> None:
    """After the bytes and the handle went concurrently (each None or the exception it raised): no record
    of a version whose bytes are not all there; raise what failed."""
    if isinstance(written, BaseException):
        if not isinstance(put, BaseException):
            await store.delete_version(version)
        raise written
    if isinstance(put, BaseException):
        raise put


def drain(tensors: Iterator[torch.Tensor]) -> None:
    """Take what is left of `hf_weights`' iterator (when sharded, each step is a gather all ranks join)."""
    for _ in tensors:
        pass
