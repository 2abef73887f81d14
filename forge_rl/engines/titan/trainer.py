"""Trainer: a TorchTitan training engine, one Monarch actor mesh (FSDP2 over its ranks). It knows no algorithm:
the loss function it is given (core/objective.py for GRPO) turns each micro-batch's log-probs into a loss.

    recipe --episodes--> train_step --> push_weights(v) --Publisher--> generators (forge_rl/weights/)

Deliberately not here: tensor/pipeline parallelism, activation checkpointing, torch.compile.
"""

import asyncio
import contextlib
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from monarch.actor import endpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import LRScheduler as TitanLRSchedulerConfig
from torchtitan.config import Optimizer as TitanOptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_

from forge_rl.compat.torch import set_scheduler_lr
from forge_rl.compat.torchtitan import tree_attention
from forge_rl.core.config import LoraConfig, OptimizerConfig
from forge_rl.core.loss import reduction
from forge_rl.core.types import Episode
from forge_rl.engines.titan import lora
from forge_rl.engines.titan.export import export_hf
from forge_rl.engines.titan.hf_weights import hf_adapter_weights, hf_weight_rows, hf_weights
from forge_rl.engines.titan.model import autocast, build_model, init_distributed, logprobs_of, pad_right, scored_logprobs, scoring_head
from forge_rl.engines.titan.scoring import ForwardPlan, add_data, batch_tensors, plan_forward, scored_positions
from forge_rl.engines.titan.value_head import NAME as VALUE_HEAD, head_values, scored_values, step_values
from forge_rl.runtime.actor import ForgeActor
from forge_rl.weights import make_publisher
from forge_rl.weights.shm import drain


NONFINITE_STEPS_BEFORE_STOPPING = 3  # in a row, each skipped: the run stops (one is a glitch, three a cause)


class Trainer(ForgeActor):
    """The policy being trained: model, AdamW, LR schedule, step counter, last pushed version.

    Every endpoint is called on ALL ranks. Invariant: every rank holds the same step count and applies the same
    update (each gets the whole batch, trains on its slice, FSDP sums gradients); a non-finite update is applied by none.

    The loss function (core/objective.py `GRPOLoss`): `prepare(tensors, **numbers) -> totals` per minibatch, then
    `loss_fn(logprobs [B, T], piece, entropy, totals) -> (loss, metrics)` per micro-batch; `piece` holds "behaviour",
    "ages", "ref" (when given) and every [B, T] tensor of `data`, which the trainer never reads; the pieces'
    gradients add up to the step's. Metrics include `num_tokens` (`reduction` says how the others combine).
    `imitation_coef` weighs imitated episodes' NLL; `value_head` true adds piece["predicted_values"] (value_head.py).
    """

    def __init__(
        self,
        model_path: str,
        loss_fn=None,  # None: a trainer that only serves log-probs and weights (train_step refuses)
        optimizer: OptimizerConfig = OptimizerConfig(),
        max_steps: int = 100,  # LR schedule length: cosine/linear decay reach 0 here (and cosine rises after)
        dtype: str = "float32",  # compute dtype: float32 on CPU, bfloat16 on GPU
        micro_batch_size: int = 8,  # sequences per forward/backward on one rank
        allowed_token_ids: list[int] | None = None,  # the generator's sampling restriction, if any
        temperature: float = 1.0,  # the generator's sampling temperature (model.py `sampling_logits`)
        weight_sync: str = "store",  # the planned transport of push_weights: shm | broadcast | store
        lora: LoraConfig | None = None,  # train LoRA adapters only (lora.py); None: every weight
    ):
        self.model_path, self.loss_fn, self.optim_config = model_path, loss_fn, optimizer
        self.max_steps, self.dtype, self.micro_batch_size = max_steps, dtype, micro_batch_size
        self.allowed_token_ids, self.temperature = allowed_token_ids, temperature
        self.weight_sync, self.lora = weight_sync, lora
        self.policy_version = 0  # the last version pushed (setup and load_checkpoint set it too)

    @endpoint
    async def setup(self) -> None:

        self.rank, self.world, self.device = init_distributed()
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // self.world))
        self.publisher = make_publisher(self.weight_sync, self.rank, self.world, self.device)
        value_head = getattr(self.loss_fn, "value_head", False)
        self.model, self.adapter = build_model(self.model_path, self.device, self.dtype, lora=self.lora, value_head=value_head)
        self.model.train()
        o = self.optim_config
        implementation = "fused" if self.device.type == "cuda" else "foreach"
        titan_optim = TitanOptimizerConfig(name="AdamW", lr=o.lr, weight_decay=o.weight_decay, implementation=implementation)
        dims = ParallelDims(dp_replicate=1, dp_shard=self.world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=self.world)
        self.optimizers = build_optimizers([self.model], titan_optim, dims)
        # "constant": no decay phase, and an unreachable horizon, since TorchTitan's schedule fails past its last step.
        constant = o.schedule == "constant"
        schedule = TitanLRSchedulerConfig(warmup_steps=o.warmup_steps, decay_ratio=0.0 if constant else None,
                                          decay_type="linear" if constant else o.schedule)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, schedule, 10**9 if constant else self.max_steps)
        self.step, self.policy_version, self.nonfinite_in_a_row = 0, 0, 0

    @endpoint
    async def train_step(
        self, batch: list[Episode], data: dict, ref_logprobs: list[torch.Tensor] | str | None = None,
        imitate: list[Episode] | None = None,
    ) -> dict[str, float]:
        """One optimizer step; every rank gets the whole batch and returns the same metrics.

        data: core/objective.py `batch_data`, [B, T'] tensors ("mask": trained positions) and numbers for the loss_fn.
        ref_logprobs: per episode [T], or "base" (LoRA): this model's with the adapters off."""
        if self.loss_fn is None:
            raise ValueError("Trainer.train_step: this trainer was built without a loss_fn")
        t = self._tensors(batch, None if ref_logprobs == "base" else ref_logprobs)
        mine = self._my_rows(len(batch))
        if ref_logprobs == "base":
            t["ref"] = self._base_logprobs(t, mine)
        totals = self.loss_fn.prepare(t, **add_data(t, data))
        plan = self._plan(t, mine)
        total_loss, tokens, forward_tokens = 0.0, 0.0, 0
        sums, lows, highs = defaultdict(float), {}, {}
        for rows, weight, served in self._micro_batches(plan, mine):
            loss, m = self._forward_loss(t, plan, rows, served, weight, totals)
            loss.backward()
            forward_tokens += m.pop("forward_tokens")
            n = m.pop("num_tokens").item()
            total_loss, tokens = total_loss + loss.item(), tokens + n
            for k, v in m.items():
                kind = reduction(k)
                if kind == "mean":
                    sums[k] += v.item() * n
                elif kind == "min":  # a piece without tokens has no ratio: it counts as +inf
                    lows[k] = min(lows.get(k, math.inf), v.item() if n > 0 else math.inf)
                else:  # "max": the loss's counts ("sum") were popped above
                    highs[k] = max(highs.get(k, -math.inf), v.item() if n > 0 else -math.inf)

        imitation_nll = self._imitation_backward(imitate, self.loss_fn.imitation_coef) if imitate else None

        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.optim_config.max_grad_norm)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        sums = self._all_sum({**sums, "loss": total_loss, "num_tokens": tokens, "forward_tokens": forward_tokens})
        # A non-finite loss or gradient norm (every rank sees the same sums and norm) is no update: AdamW would
        # write NaN into every weight and its moments, and the push would carry them to the generators.
        finite = math.isfinite(sums["loss"]) and math.isfinite(grad_norm.item())
        if finite:
            await self.publisher.sent()  # the last push may still be sending these parameters
            self.held_version = None  # from here until the next push they are no published version
            self.optimizers.step()
            self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.step += 1
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        if self.nonfinite_in_a_row >= NONFINITE_STEPS_BEFORE_STOPPING:
            raise FloatingPointError(f"train_step: optimizer steps {self.step - self.nonfinite_in_a_row + 1}-{self.step} had a "
                                     f"non-finite loss {sums['loss']:g} or gradient norm {grad_norm.item():g} (all skipped, the "
                                     "weights untouched): look for a learning rate too high, a bf16 overflow, non-finite advantages")

        forward_tokens = sums.pop("forward_tokens")
        n = max(sums.pop("num_tokens"), 1.0)
        metrics = {"loss": sums.pop("loss"), **{k: v / n for k, v in sums.items()}}
        extremes = self._all_max({**{k: -v for k, v in lows.items()}, **highs})
        metrics.update({k: -extremes[k] if k in lows else extremes[k] for k in extremes if math.isfinite(extremes[k])})
        metrics.update(grad_norm=grad_norm.item(), lr=lr, step=self.step, num_tokens=n, forward_tokens=forward_tokens,
                       skipped_steps=float(not finite))
        if imitation_nll is not None:
            metrics.update(imitation_nll=imitation_nll, imitation_episodes=len(imitate))
        return metrics

    @endpoint
    async def score_batch(self, batch: list[Episode], masks: list[torch.Tensor], values: bool, entropy: bool) -> dict:
        """What an objective fixes once per batch, before its updates. `values`: each episode's [T] value-head
        values (V before each sampled token, 0 elsewhere); `entropy`: mean next-token entropy where `masks` mark."""
        t, mine, out = self._tensors(batch, None), self._my_rows(len(batch)), {}
        with torch.no_grad():
            pieces = list(self._scored_pieces(t, mine))
        if values:
            v = step_values(pieces, t["mask"], self.device)
            out["values"] = [v[i, : len(e.tokens)] for i, e in enumerate(batch)]
        if entropy:
            trained, total, tokens = pad_right([torch.as_tensor(m).float() for m in masks], t["tokens"].shape[1]), 0.0, 0.0
            for episodes, _, h, width, weight, _ in pieces:
                m = trained[episodes, 1 : width + 1].to(self.device) * weight
                total, tokens = total + (h * m).sum().item(), tokens + m.sum().item()
            sums = self._all_sum({"entropy": total, "tokens": tokens})
            out["mean_entropy"] = sums["entropy"] / max(sums["tokens"], 1.0)
        return out

    @endpoint
    async def push_weights(self, version: int, receivers: list[int] | None = None) -> int:
        """HF-named weights by the planned transport (with LoRA, the adapters alone); returns the bytes once
        generators can fetch them. A broadcast may still be under way: the next push and optimizer step wait for it.
        `receivers`: the generator replicas a broadcast goes to."""
        shapes, tensors, adapter, rows = self._outgoing()
        async with self._sending(tensors):
            await self.publisher.publish(shapes, tensors, version, rows, adapter, receivers)
        self.policy_version = self.held_version = version
        return sum(t.numel() * t.element_size() for t in shapes.values())

    @endpoint
    async def resend_weights(self, replica: int, version: int) -> bool:
        """Broadcast `version` again to one rejoined replica; False if an optimizer step has changed the parameters."""
        if getattr(self, "held_version", None) != version:
            return False
        _, tensors, _, _ = self._outgoing()
        async with self._sending(tensors):
            self.publisher.resend(replica, tensors, version)
        return True

    @contextlib.asynccontextmanager
    async def _sending(self, tensors):
        """Around a push: whatever failed on one rank, the others wait in its gathers and at the barrier."""
        try:
            yield
        finally:
            await asyncio.to_thread(drain, tensors)
            if dist.is_initialized():
                dist.barrier()

    def _outgoing(self) -> tuple[dict, object, dict | None, bool]:
        """What a push publishes: shapes, the tensors (an iterator), the LoRA scale, whether by rows."""
        if self.lora:
            shapes, tensors = hf_adapter_weights(self.model, self.adapter, self.dtype)
            return shapes, tensors, {"scale": lora.scale(self.model)}, False
        rows = self.publisher.every_rank_writes
        return *(hf_weight_rows if rows else hf_weights)(self.model, self.adapter, self.dtype), None, rows

    @endpoint
    async def join_weights_group(self, rendezvous: str, port: int, world: int, bind: str, replica: int = 0) -> None:
        """Rendezvous with one generator replica's join: rank 0 joins its broadcast group as rank 0 and hosts it."""
        await asyncio.to_thread(self.publisher.join, rendezvous, port, world, bind, replica)

    @endpoint
    async def logprobs(self, token_ids: list[torch.Tensor], base: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs, each [T] aligned with its ids (position 0 is 0). `base`: LoRA adapters off."""
        self.model.eval()
        try:
            with lora.adapters_off(self.model) if base else contextlib.nullcontext():
                return logprobs_of(self.model, token_ids, self.device, self.dtype, self.micro_batch_size, self.allowed_token_ids, self.temperature)
        finally:
            self.model.train()

    @endpoint
    async def export_hf(self, path: str) -> None:
        """All ranks gather the weights; rank 0 writes a plain HF directory at `path` (export.py)."""
        export_hf(self.model, self.adapter, self.model_path, path, self.lora)

    @endpoint
    async def save_checkpoint(self, path: str) -> None:

        dcp.save(self._checkpoint_state(), checkpoint_id=path)

    @endpoint
    async def load_checkpoint(self, path: str) -> dict[str, int]:
        """Any earlier number of ranks works for the model and optimizer."""
        await self.publisher.sent()
        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=not self.lora))
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        self._apply_schedule()
        self.step, self.policy_version = int(state["progress"]["step"]), int(state["progress"]["policy_version"])
        return {"step": self.step, "policy_version": self.policy_version}

    async def __cleanup__(self, exc: Exception | None) -> None:
        """Unlink the shared-memory buffers (after a kill -9, Generator cleanup removes them instead)."""
        if hasattr(self, "publisher"):
            self.publisher.close()

    # ------------------------------------------------------------------------ helpers

    def _checkpoint_state(self) -> dict:
        """With LoRA the model's part is the adapters (and a value head) alone: the base weights are the model directory's."""
        model = get_model_state_dict(self.model)
        return {
            "model": {k: v for k, v in model.items() if ".lora_" in k or k.startswith(VALUE_HEAD)} if self.lora else model,
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "progress": {"step": self.step, "policy_version": self.policy_version},
        }

    def _apply_schedule(self) -> None:
        """The checkpoint holds the saving run's lr (0 at the end of a decay): a resume with more max_steps needs its own."""
        for scheduler in self.lr_schedulers.schedulers:
            set_scheduler_lr(scheduler, [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)])

    def _tensors(self, batch: list[Episode], ref_logprobs) -> dict[str, torch.Tensor]:
        return batch_tensors(batch, ref_logprobs, self.policy_version)

    def _forward_loss(self, t: dict, plan: ForwardPlan, rows: list[int], episodes: list[int], weight: float, totals):
        """The loss of `episodes` from one forward of the `rows` that serve them (scoring.py)."""
        lp, entropy, width, anchor, values = self._score(t, plan, rows, episodes)
        piece = {k: v[episodes, 1 : width + 1].to(self.device) for k, v in t.items() if v.dim() == 2 and k != "tokens"}
        piece["mask"] = piece["mask"] * weight
        piece.update({} if values is None else {"predicted_values": values})
        loss, metrics = self.loss_fn(lp, piece, entropy, totals)
        return loss + anchor, {**metrics, "forward_tokens": len(rows) * max(len(plan.ids[r]) for r in rows)}  # padding included

    def _score(self, t: dict, plan: ForwardPlan, rows: list[int], episodes: list[int]):
        """One forward of `rows`, the output head only where a trained token of `episodes` is predicted.

        Log-probs, entropies and values are [len(episodes), width], column j for position j + 1. `anchor` is a
        zero tying every parameter to the loss: a rank that trains nothing still runs FSDP's backward collectives."""
        width = max([plan.needed[b] for b in episodes] + [1])
        ids, depths, attention = plan.inputs(rows)
        slots, positions, index, which = scored_positions(plan, t["mask"], episodes, rows, ids.shape[1])
        with autocast(self.device, self.dtype), scoring_head(self.model, index.to(self.device)), head_values(self.model) as head, \
                tree_attention(self.model, attention.to(self.device)):
            logits = self.model(ids.to(self.device), positions=depths.to(self.device))  # [len(index), V]
        targets = t["tokens"][episodes][slots, positions].to(self.device)
        lp_tokens, entropy_tokens = scored_logprobs(logits, which.to(self.device), targets, self.allowed_token_ids, self.temperature)
        lp = torch.zeros(len(episodes), width, device=self.device)
        entropy = torch.zeros(len(episodes), width, device=self.device)
        lp[slots, positions - 1], entropy[slots, positions - 1] = lp_tokens, entropy_tokens
        values = scored_values(head, which, slots, positions, (len(episodes), width))  # None without a value head
        anchor = 0.0 * logits.float().sum() + (0.0 * values.sum() if values is not None else 0.0)
        return lp, entropy, width, anchor, values

    def _scored_pieces(self, t: dict, mine: list[int]):
        """Each micro-batch scored as the loss scores it; call under torch.no_grad."""
        plan = self._plan(t, mine)
        for rows, weight, episodes in self._micro_batches(plan, mine):
            lp, entropy, width, _, values = self._score(t, plan, rows, episodes)
            yield episodes, lp, entropy, width, weight, values

    @torch.no_grad()
    def _base_logprobs(self, t: dict, mine: list[int]) -> torch.Tensor:
        """The KL reference under LoRA: trained tokens' log-probs with the adapters off, scored as the loss scores."""
        ref = torch.zeros_like(t["mask"])
        with lora.adapters_off(self.model):
            for episodes, lp, _, width, _, _ in self._scored_pieces(t, mine):
                ref[episodes, 1 : width + 1] = lp.float().cpu()
        return ref

    def _imitation_backward(self, episodes: list[Episode], coef: float) -> float:
        """Backward of coef x the mean NLL of the episodes' sampled tokens; returns that NLL."""
        t = self._tensors(episodes, None)
        denominator = t["mask"].sum().clamp(min=1).item()
        mine = self._my_rows(len(episodes))
        plan = self._plan(t, mine)
        nll = 0.0
        for rows, weight, served in self._micro_batches(plan, mine):
            lp, _, width, anchor, _ = self._score(t, plan, rows, served)
            piece_nll = -(lp * t["mask"][served, 1 : width + 1].to(self.device)).sum() * weight / denominator
            (coef * piece_nll + anchor).backward()
            nll += piece_nll.item()
        return self._all_sum({"nll": nll})["nll"]

    def _plan(self, t: dict, mine: list[int]) -> ForwardPlan:
        return plan_forward(t["tokens"], t["lengths"], t["mask"], mine, self.micro_batch_size)

    def _micro_batches(self, plan: ForwardPlan, mine: list[int]):
        """(rows, loss weight, the episodes of `mine` they serve) micro-batches. Every rank runs as many passes
        (FSDP's collectives pair up): one short of rows runs row 0 weighted 0, serving none."""
        n_micro = max(1, int(self._all_max({"n": math.ceil(len(plan.ids) / plan.per_pass)})["n"]))
        for piece in torch.tensor_split(torch.arange(len(plan.ids)), n_micro):
            rows = piece.tolist()
            yield (rows, 1.0, [b for b in mine if plan.row_of[b] in rows]) if rows else ([0], 0.0, [])

    def _my_rows(self, n: int) -> list[int]:
        """This rank's contiguous slice of a batch of n (sizes differ by at most one)."""
        return torch.tensor_split(torch.arange(n), self.world)[self.rank].tolist()

    def _all_max(self, values: dict[str, float]) -> dict[str, float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_sum(self, values: dict[str, float]) -> dict[str, float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def _all_reduce(self, values: dict[str, float], op) -> dict[str, float]:
        if self.world == 1 or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return dict(zip(keys, t.tolist()))
