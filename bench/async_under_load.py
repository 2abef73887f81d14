"""Asynchronous training under an artificial CPU load against synchronous training under the same load.

    python bench/async_under_load.py [--load 4] [--steps 100] [overrides ...]

`--load` processes spin on the CPU for the whole bench (on 2 cores, 4 of them give a load average near 6,
as other jobs did when asynchronous learning was seen to drift). Under that load, `make train`'s config runs
twice for `--steps`: synchronously, then asynchronously with partial rollouts and geometric-mean IS masking,
each evaluated greedily on the config's fixed deals. Staleness is bounded where data is produced (the loop
admits no new group while the oldest in flight is on its last trainable version), so the asynchronous run's
token ages stay within `grpo.max_policy_age`; whether its learning keeps up is the first line. Printed, from
each run's metrics.jsonl:

    async_under_load ev_luck_corrected async=<x> sync=<y> diff=<x-y>      at the last evaluation
    async_under_load minutes async=<x> sync=<y> ratio=<x/y>
    async_under_load token_age mean=<x> p90_max=<y> ge2_max=<z>           per trained token, over the run
    async_under_load is_masked_fraction mean=<x> max=<y> (step <s>); mixed_version_episodes max=<z>; admission_waits=<n>

Both runs stay in `--out` (default: a new temporary directory, printed) for their metrics.jsonl and curves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from forge_rl.recipes.metrics import read_metrics  # noqa: E402

ASYNC = ["synchronous=false", "generator.partial_rollouts=true", "grpo.is_correction.level=geo", "grpo.is_correction.mode=mask"]


def spin() -> None:
    while True:
        pass


def run(overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """One run of configs/blackjack_tiny_cpu.yaml into `run_dir`: its metrics rows and its minutes."""
    command = [sys.executable, "-m", "forge_rl.grpo", "--config", "configs/blackjack_tiny_cpu.yaml", f"run_dir={run_dir}", *overrides]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"forge_rl.grpo failed ({done.returncode}): {done.stderr[-2000:]}")
    return read_metrics(run_dir), (time.monotonic() - start) / 60


def last(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r] or [0.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=4, help="busy-looping processes running throughout")
    parser.add_argument("--steps", type=int, default=100, help="train steps per run")
    parser.add_argument("--out", type=Path, default=None, help="keep both runs here (sync/, async/); default: a temporary directory")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for both runs")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="async_under_load_"))

    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    try:
        common = [f"trainer.max_steps={args.steps}", f"eval.interval={args.steps}", *args.overrides]
        sync_rows, sync_min = run(common, out / "sync")
        async_rows, async_min = run([*ASYNC, *common], out / "async")
    finally:
        for p in spinners:
            p.kill()

    print(f"runs: {out}")
    ev = "eval/ev_luck_corrected"
    a, s = last(async_rows, ev), last(sync_rows, ev)
    print(f"async_under_load ev_luck_corrected async={a:.3f} sync={s:.3f} diff={a - s:+.3f}")
    print(f"async_under_load minutes async={async_min:.1f} sync={sync_min:.1f} ratio={async_min / sync_min:.2f}")
    print(f"async_under_load token_age mean={statistics.mean(series(async_rows, 'train/token_age_mean')):.3f} "
          f"p90_max={max(series(async_rows, 'train/token_age_p90')):.2f} ge2_max={max(series(async_rows, 'train/token_age_ge2')):.3f}")
    masked = series(async_rows, "train/is_masked_fraction")
    worst = max((r for r in async_rows if "train/is_masked_fraction" in r), key=lambda r: r["train/is_masked_fraction"], default={})
    print(f"async_under_load is_masked_fraction mean={statistics.mean(masked):.3f} max={max(masked):.3f} (step {worst.get('step')}); "
          f"mixed_version_episodes max={max(series(async_rows, 'train/mixed_version_episodes')):.3f}; "
          f"admission_waits={last(async_rows, 'rollout/admission_waits'):.0f}")


if __name__ == "__main__":
    main()
