"""Fault-injection soak: a BlackJack run during which a small injector kills, at random times, what a
real cluster loses. Not part of `make test` (it runs for as long as it is told, 20 minutes by default).

    python bench/faults.py [--minutes 20] [--mean-gap-s 90] [--seed 0] [dotted.key=value ...]

The run is `python -m forge_rl.grpo --config configs/blackjack_tiny_cpu.yaml` with trainer.restart_on_failure
on, its app bench/hostile_app.py (BlackJack's, with bad input on demand), against a BlackJack server this
script starts (bench/hostile_env.py; so that it can kill it and start it again on the same port, as a
Kubernetes pod restart does). Faults, each at a random time (exponential gaps of mean --mean-gap-s), in turn:
  env_server   kill -9 of the environment server, started again on its port 3 s later
  engine       kill -9 of a generator's vLLM engine process (VLLM::EngineCore)
  generator    kill -9 of a generator's whole Monarch process (its engine goes with it)
  trainer      kill -9 of the trainer's process (once; the run starts again from its last checkpoint)
  nan_reward, inf_reward, raise_reward   the next game's reward is NaN, +inf, or raises
  hung_reward  the server's next scoring step hangs past env.timeout_s
  overflow     the next prompt after a first decision outgrows generator.max_model_len
  parser       the next answer reaches the tool-call parser behind text that crashed it (RecursionError)
A fault is survived when the run trains at least one more step after it (or ends its steps). At the end:

    faults injected=<n> survived=<m> steps=<k> lost_groups=<g>
    bad input taken=<t>: groups lost {<reason>: <n>}, prompts cut off <p>; beyond their own groups: <b>
    final eval EV=<ev> (luck-corrected <ev'>)

lost_groups: groups lost (a session not restored, a game's error), over every part of the run (a restarted
run counts again from 0). Bad input taken by a training game costs at most its group (an evaluation game's, none);
an overflow and a parser fault cost none: <b> counts the groups lost beyond that. The goal: every fault
survived, b = 0, the run ends its steps, final eval EV >= -0.08 (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.armed import arm, taken  # noqa: E402
from forge_rl.envs.local import launch_local  # noqa: E402
from forge_rl.recipes.metrics import read_metrics  # noqa: E402

CONFIG = ROOT / "configs" / "blackjack_tiny_cpu.yaml"
BAD_INPUT = {"nan_reward": "reward_not_finite", "inf_reward": "reward_not_finite", "raise_reward": "ArithmeticError",
             "hung_reward": "env_timeout", "overflow": None, "parser": None}  # fault -> the reason of the group it may cost
FAULTS = ("env_server", "engine", "generator", "trainer", *BAD_INPUT)


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir) if "train/loss" in r), default=0)


def counted(run_dir: Path, key: str) -> int:
    """A counter of the metrics summed over the parts of a run (it restarts with each restart of the run)."""
    total, last = 0, 0
    for row in read_metrics(run_dir):
        if key in row:
            value = int(row[key])
            if value < last:
                total += last
            last = value
    return total + last


def lost_groups(run_dir: Path) -> dict[str, int]:
    """Groups lost by reason (rollout/lost_groups/<reason>) over every part of the run."""
    keys = {k for row in read_metrics(run_dir) for k in row if k.startswith("rollout/lost_groups/")}
    return {k.removeprefix("rollout/lost_groups/"): counted(run_dir, k) for k in sorted(keys)}


def bad_input_report(run_dir: Path, faults_dir: str) -> str:
    """What the bad input cost: groups lost by reason (any cause's, kills' included), prompts cut off, and the
    groups lost to its reasons beyond one per fault taken (0 when each cost at most its own group)."""
    lost = lost_groups(run_dir)
    took = {fault: taken(faults_dir, fault) for fault in BAD_INPUT}
    allowed = {reason: sum(n for f, n in took.items() if BAD_INPUT[f] == reason) for reason in lost}
    beyond = sum(max(n - allowed[reason], 0) for reason, n in lost.items() if reason in BAD_INPUT.values() or reason == "RecursionError")
    return (f"bad input taken={sum(took.values())} {took}: groups lost {lost}, prompts cut off {counted(run_dir, 'rollout/prompt_overflows')}; "
            f"beyond their own groups: {beyond}")


def engine_processes(app: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(app.pid).children(recursive=True) if _name(p) == "VLLM::EngineCore"]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def trainer_pid(run_dir: Path) -> int | None:
    found = re.findall(r"forge_rl Trainer: host=\S+ pid=(\d+)", (run_dir / "run.log").read_text(errors="replace"))
    return int(found[-1]) if found else None


def inject(fault: str, app: subprocess.Popen, server, run_dir: Path) -> str:
    """Cause `fault`; returns what was done, in words."""
    if fault in BAD_INPUT:
        arm(os.environ["FORGE_RL_FAULTS_DIR"], fault)
        return f"armed {fault} for the next call it concerns"
    if fault == "env_server":
        pid = server.proc.pid
        server.proc.kill()
        server.proc.wait()
        time.sleep(3)
        server.start(timeout_s=120)
        return f"killed the environment server (pid {pid}), started it again on its port after 3 s"
    if fault in ("engine", "generator"):
        engines = engine_processes(app)
        if not engines:
            return "no vLLM engine found (a generator is restarting); nothing killed"
        engine = random.choice(engines)
        victim = engine if fault == "engine" else engine.parent()
        os.kill(victim.pid, signal.SIGKILL)
        return f"killed {'the vLLM engine' if fault == 'engine' else 'a generator process'} (pid {victim.pid})"
    pid = trainer_pid(run_dir)
    if pid is None or not psutil.pid_exists(pid):
        return "no trainer found; nothing killed"
    os.kill(pid, signal.SIGKILL)
    return f"killed the trainer (pid {pid})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long faults are injected")
    parser.add_argument("--mean-gap-s", type=float, default=90.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for the run's config")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="forge_rl_faults_"))
    os.environ["FORGE_RL_FAULTS_DIR"] = tempfile.mkdtemp(prefix="forge_rl_armed_")  # read by the server and the run
    with launch_local("bench.hostile_env:HostileBlackJack", max_concurrent_envs=64, timeout_s=180) as server:
        command = [
            sys.executable, "-m", "forge_rl.grpo", "--config", str(CONFIG), f"run_dir={run_dir}", f"env.url={server.url}",
            "app_module=bench.hostile_app", "trainer.restart_on_failure=true", "trainer.checkpoint_every=10", *args.overrides,
        ]
        print("run:", " ".join(command[2:]), flush=True)
        app = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = []
        threading.Thread(target=lambda: output.extend(app.stdout), daemon=True).start()
        deadline = time.time() + args.minutes * 60
        schedule = [f for f in FAULTS if f != "trainer"]
        trainer_done, injected = False, []  # (fault, step at injection)
        while trained_steps(run_dir) < 1 and app.poll() is None:
            time.sleep(2)  # faults start once training does
        while time.time() < deadline and app.poll() is None:
            time.sleep(min(rng.expovariate(1 / args.mean_gap_s), max(deadline - time.time(), 0)))
            if app.poll() is not None or time.time() >= deadline:
                break
            fault = "trainer" if not trainer_done and len(injected) >= 2 else schedule[len(injected) % len(schedule)]
            trainer_done |= fault == "trainer"
            step = trained_steps(run_dir)
            print(f"[{time.strftime('%H:%M:%S')}] step {step}: {fault}: {inject(fault, app, server, run_dir)}", flush=True)
            injected.append((fault, step))
        if app.poll() is None:
            print("fault injection over; waiting for the run to end its steps", flush=True)
        rc = app.wait()
        steps = trained_steps(run_dir)
        ended = rc == 0
        survived = 0
        for i, (fault, step) in enumerate(injected):
            # survived: a step trained after it (before the next fault, or by the end of a run that ended well)
            later = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r and r["step"] > step]
            ok = bool(later) or (ended and steps >= step)
            survived += ok
            print(f"  {fault:<10} at step {step:>4}: {'survived' if ok else 'NOT survived'}")
        restarts = sum("trainer.restart_on_failure: starting again" in line for line in output)
        print(f"run exit status {rc}; trainer restarts {restarts}; run_dir {run_dir}")
        if rc != 0:
            print("".join(output[-40:]))
        print(f"faults injected={len(injected)} survived={survived} steps={steps} lost_groups={sum(lost_groups(run_dir).values())}")
        print(bad_input_report(run_dir, os.environ["FORGE_RL_FAULTS_DIR"]))
        evals = [r for r in read_metrics(run_dir) if "eval/ev" in r]
        if evals:
            last = evals[-1]
            print(f"final eval EV={last['eval/ev']:+.3f} (luck-corrected {last.get('eval/ev_luck_corrected', float('nan')):+.3f}) "
                  f"at step {last['step']}")
        else:
            print("final eval EV: none (no evaluation ran)")


if __name__ == "__main__":
    main()
