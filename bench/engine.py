"""The engine's three figures, each a ratio against a baseline measured in the same run (issue 4).

    generation    tokens/s   Generator actor (Monarch)       / the same vLLM AsyncLLM in-process
    weight sync   time       {k: v.clone()} of the state dict / push until the generator serves it (shm)
    train step    time       Trainer.train_step (Monarch)    / the same fwd + bwd + AdamW inline

Runs bench/engine_generation.py, engine_weight_sync.py and engine_train.py in turn, each in its own
process: each starts its own Monarch processes, vLLM engines and TorchStore, and a fresh controller
keeps one bench's leftovers out of the next one's timings. Prints each bench's own summary, then the
three ratios. Figures, not asserts; a bench that fails is reported and the others still run.

Defaults fit a few minutes on two CPU cores. Bigger runs pass flags through to a bench, e.g.

    python bench/engine.py --generation "--hidden 512 --layers 4 --rounds 10" \\
        --weight-sync "--sizes 256,1024" --train "--hidden 512 --layers 4 --steps 5"
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent

# name, script, first line of its summary, its ratio line, what the ratio divides
BENCHES = [
    ("generation", "engine_generation.py", "model:", r"actor / in-process: ([\d.]+)",
     "tokens/s, Generator actor / vLLM in-process"),
    ("weight sync", "engine_weight_sync.py", "weight_sync_vs_memcpy",
     r"weight_sync_vs_memcpy path=shm size_mb=\d+ ratio=([\d.]+)", "seconds, in-memory copy / shm update end to end"),
    ("train step", "engine_train.py", "model hidden=", r"ratio actor / baseline: ([\d.]+)",
     "seconds, Trainer actor / inline (above 1: slower)"),
]


def summary(output: str, first: str, ratio_pattern: str) -> tuple[list[str], float | None]:
    """The bench's summary lines (from `first` to the end of its stdout, logs dropped) and its ratio."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(first)), len(lines))
    block = [line for line in lines[start:] if line.strip() and not line.startswith(("(", "INFO", "WARNING"))]
    ratios = [float(m.group(1)) for line in block if (m := re.match(ratio_pattern, line))]
    return block, ratios[-1] if ratios else None


def run(script: str, flags: str, log: Path) -> tuple[int, str, float]:
    """Run one bench; stdout and stderr go to `log`. Returns (exit code, stdout, wall seconds)."""
    paths = [str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, str(BENCH_DIR / script), *shlex.split(flags)],
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    with open(log, "a") as out:
        out.write(proc.stdout)
    return proc.returncode, proc.stdout, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generation", default="", help="flags for engine_generation.py")
    parser.add_argument("--weight-sync", default="--sizes 256 --rounds 2", help="flags for engine_weight_sync.py")
    parser.add_argument("--train", default="--steps 3", help="flags for engine_train.py")
    parser.add_argument("--log-dir", default=None, help="where each bench's full output goes (default: a temp dir)")
    args = parser.parse_args()
    flags = [args.generation, args.weight_sync, args.train]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="forge_rl_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    print("forge_rl engine bench: each figure is a ratio against a baseline measured in the same run.")
    print(f"host: {os.cpu_count()} CPUs, {device}, load average {os.getloadavg()[0]:.1f} at start; "
          f"torch {torch.__version__}; full logs in {log_dir}")
    results = []
    for (name, script, first, pattern, meaning), bench_flags in zip(BENCHES, flags):
        print(f"\n== {name}: {script} {bench_flags}".rstrip())
        log = log_dir / f"{Path(script).stem}.log"
        code, stdout, seconds = run(script, bench_flags, log)
        block, ratio = summary(stdout, first, pattern)
        if block:
            print("\n".join(block))
        if code != 0 or ratio is None:
            print("\n".join(log.read_text().splitlines()[-20:]))
            print(f"{name}: FAILED (exit code {code}); see {log}")
        print(f"({seconds:.0f} s)")
        results.append((name, ratio, meaning))

    print("\n== ratios (1.00 = no cost over the baseline)")
    for name, ratio, meaning in results:
        print(f"{name:12s} {'failed' if ratio is None else f'{ratio:6.2f}':>7s}   {meaning}")
    return 0 if all(ratio is not None for _, ratio, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
