"""SmolLM2-135M writing functions (configs/coder_smollm2_cpu.yaml) end to end: how fast the loop plays, grades and
trains, and the train step and generation against what this machine's matmuls allow.

    python bench/code_model.py [--steps 8] [overrides ...]

One run of `python -m forge_rl.grpo` on the config for a few steps (no evaluation, no checkpoint), read back from
its metrics.jsonl; the first two steps are warm-up. Printed:

    code_loop episodes_per_s ours=<x> (per step: generation g s, grading e s, train t s, weight sync w s, other o s)
        generation and grading split the step's collection by the share of the games' time each waited on the
        policy and on the code server (rollout/policy_s, rollout/env_s)
    code_train tokens_per_s ours=<x> floor=<y> ratio=<x/y>
        the episodes' tokens trained per second of train step (LoRA): floor = this machine's fp32 matmul rate,
        measured here, / 4N FLOPs a token (forward 2N, backward 2N without weight gradients but the adapters'),
        N the parameters of the transformer blocks
    code_generation tokens_per_s ours=<x> floor=<y> ratio=<x/y>
        the tokens sampled per second of generation (collection less grading): floor = matmul rate / 2N, a
        decoded token's forward alone (prompts are prefilled too and a group's shared prompt once: not counted)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import ROOT, WARMUP, block_parameters, matmul_flops_per_s, median, run  # noqa: E402

CONFIG = ROOT / "configs/coder_smollm2_cpu.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps, the first two a warm-up")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = parser.parse_args()

    flops, n = matmul_flops_per_s(), block_parameters()
    rows, _ = run(args.overrides, args.steps, CONFIG)
    timed, before = rows[WARMUP:], rows[WARMUP - 1]
    print(f"matmul {flops / 1e9:.1f} GFLOP/s; {n / 1e6:.1f}M parameters in the blocks")

    wall = (timed[-1]["time"] - before["time"]) / len(timed)
    env_s = (timed[-1]["rollout/env_s"] - before["rollout/env_s"]) / len(timed)
    policy_s = (timed[-1]["rollout/policy_s"] - before["rollout/policy_s"]) / len(timed)
    collect = statistics.mean(r["time/collect_s"] for r in timed)
    grading = collect * env_s / max(env_s + policy_s, 1e-9)
    generation = collect - grading
    train = statistics.mean(r["time/train_step_s"] for r in timed)
    sync = statistics.mean(r["time/push_weights_s"] + r["time/update_weights_s"] for r in timed)
    episodes = statistics.mean(r["train/batch_episodes"] for r in timed)
    print(f"code_loop episodes_per_s ours={episodes / wall:.2f} (per step of {wall:.1f} s: generation {generation:.1f} s, "
          f"grading {grading:.1f} s, train {train:.1f} s, weight sync {sync:.2f} s, other {wall - collect - train - sync:.2f} s)")

    tokens_per_s = median(rows, "train/episode_tokens") / median(rows, "time/train_step_s")
    floor = flops / (4 * n)
    print(f"code_train tokens_per_s ours={tokens_per_s:.1f} floor={floor:.1f} ratio={tokens_per_s / floor:.2f} "
          f"(4N = {4 * n / 1e9:.2f} GFLOP a token; {median(rows, 'train/forward_tokens'):.0f} tokens run through the model a step, "
          f"padding included, for {median(rows, 'train/episode_tokens'):.0f} episode tokens)")
    sampled = statistics.mean(r["train/sampled_tokens"] for r in timed)
    floor = flops / (2 * n)
    print(f"code_generation tokens_per_s ours={sampled / generation:.1f} floor={floor:.1f} ratio={sampled / generation / floor:.2f} "
          f"(2N = {2 * n / 1e9:.2f} GFLOP a token; {sampled:.0f} tokens sampled a step, {median(rows, 'train/truncated'):.2f} of answers cut at max_tokens)")


if __name__ == "__main__":
    main()
