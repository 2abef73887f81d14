"""Start-up: seconds from the command to the untrained policy's evaluation, against one vLLM engine's start, in one run.

Measured: `python -m forge_rl.grpo --config CONFIG trainer.max_steps=1` in a fresh process, until its console prints
the step-0 evaluation (`step 0 ...`: the environment server, every actor and the engine up, the evaluation played),
then until it exits (one train step, the final evaluation, the export, every process stopped).
Baseline: the least any vLLM-based loop pays before its first answer: a fresh process that imports vLLM, builds
the policy's engine (forge_rl's own `engine_args`, the config's model) and samples one answer. The two alternate
`--rounds` times so both see the same machine load; the ratio is what the framework's start costs on top of its
engine's. Figures only, no asserts.

    python bench/startup.py [--config configs/sums_smollm2_cpu.yaml] [--rounds 2] [key=value ...]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINE = """
import asyncio, os, sys
from forge_rl.core.config import load_config
from forge_rl.engines.vllm.cpu import cpu_environment
from forge_rl.engines.vllm.generator import engine_args
from forge_rl.models import resolve_model
from vllm import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

async def main():
    cfg = load_config(sys.argv[2], sys.argv[3:])  # argv[1]: where the tiny model is built, if it is the config's
    os.environ.update(cpu_environment(cfg.generator.procs))  # as the Generator sets them (on CPU)
    engine = AsyncLLM.from_engine_args(engine_args(resolve_model(cfg.model.path, cfg.model.dtype, sys.argv[1], 0), cfg.model.dtype, cfg.generator))
    async for _ in engine.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), request_id="0"):
        pass
    engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


def timed(argv: list[str], mark: str | None = None) -> tuple[float | None, float]:
    """Seconds until a console line starting with `mark` (None: not asked or never printed), and until exit."""
    start, seen = time.perf_counter(), None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if mark and seen is None and line.startswith(mark):
                seen = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{argv[2]} exited with {proc.returncode}")
    return seen, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sums_smollm2_cpu.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for python -m forge_rl.grpo")
    args = parser.parse_args()
    ours, whole, base = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "engine.py"
        script.write_text(ENGINE)
        print(f"load before: {os.getloadavg()}")
        for i in range(args.rounds):
            run = [sys.executable, "-m", "forge_rl.grpo", "--config", args.config, f"run_dir={tmp}/run{i}", "trainer.max_steps=1",
                   "eval.interval=1", "trainer.checkpoint_every=0", *args.overrides]
            to_eval, to_exit = timed(run, "step 0 ")
            ours.append(to_eval)
            whole.append(to_exit)
            base.append(timed([sys.executable, str(script), f"{tmp}/tiny", args.config, *args.overrides])[1])
            print(f"round {i}: to the step-0 evaluation {to_eval:.1f} s, to the exit of a 1-step run {to_exit:.1f} s; engine alone {base[-1]:.1f} s")
        print(f"load after: {os.getloadavg()}")
    o, b = statistics.median(ours), statistics.median(base)
    print(f"startup_vs_engine seconds ours={o:.1f} baseline={b:.1f} ratio={o / b:.2f}  (one-step run to exit: {statistics.median(whole):.1f} s)")


if __name__ == "__main__":
    main()
