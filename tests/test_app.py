"""The BlackJack app as users run it: `python -m forge_rl.grpo --config ...` in a subprocess, with
real Monarch actors, vLLM, TorchStore and a BlackJack server on loopback.

Run 1 trains two steps (synchronous: generate, then train) and checkpoints; run 2 resumes from that
checkpoint (same step and policy version onwards) with rollouts overlapping training, and is stopped
with Ctrl-C mid-run, which must end it cleanly with no process left behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "blackjack_tiny_cpu.yaml"
SMALL = [
    "grpo.batch_size=2", "grpo.group_size=4", "rollout.num_workers=2", "eval.interval=2", "eval.num_games=16",
    "trainer.checkpoint_every=2", "logging.tensorboard=true",
]


def app(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forge_rl.grpo", "--config", str(CONFIG), f"run_dir={run_dir}", *SMALL, *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for_a_train_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and not any(r["step"] >= step and "train/loss" in r for r in metrics(run_dir)):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)


def stop_and_check_nothing_is_left(proc: subprocess.Popen, sig: int) -> str:
    """Send `sig` to a running app; it must exit with 130 and take every process it started with it."""
    spawned = descendants(proc)
    assert len(spawned) >= 4, "expected the app's actor and engine processes"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in out, out[-3000:]
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, f"processes left behind after {signal.Signals(sig).name}: {[p.cmdline()[:3] for p in alive]}"
    return out


def test_train_checkpoint_resume_and_ctrl_c(tmp_path):
    run_dir = tmp_path / "run"
    # eval.interval=5 > max_steps: the evaluation at step 2 is the one every run makes of its final policy
    first = app(run_dir, "trainer.max_steps=2", "synchronous=true", "eval.interval=5")
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]

    rows = metrics(run_dir)
    references = rows.pop(0)  # logged once at the start: the reference policies on the eval deals
    assert references["step"] == 0 and -1 <= references["eval/reference/basic_strategy"] <= 1
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    for key in ("train/loss", "train/reward", "train/entropy", "eval/ev", "eval/win", "eval/invalid_rate"):
        assert key in last, key
    assert last["eval/games"] == 16 and -1 <= last["eval/ev"] <= 1
    # the luck-corrected EV: the model's EV less basic strategy's on the same deals, plus its exact EV
    corrected = last["eval/ev"] - references["eval/reference/basic_strategy"] - 0.0428
    assert abs(last["eval/ev_luck_corrected"] - corrected) < 1e-9
    assert last["train/invalid_rate"] == 0, "constrained decoding makes every answer valid"
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert "eval/ev" not in rows[0], "step 1 is neither on eval.interval nor the last step"
    assert "group_size: 4" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "tensorboard").iterdir())
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2 and latest["version"] == 2 and last["train/policy_version"] == 2

    # Resume: continues at step 3 with policy version 3, then Ctrl-C.
    second = app(run_dir, "resume=true", "trainer.max_steps=50", "synchronous=false")  # rollouts overlap training
    wait_for_a_train_step(second, run_dir, 3)
    resumed = [r for r in metrics(run_dir) if r["step"] >= 3 and "train/loss" in r]
    assert resumed and resumed[0]["step"] == 3
    assert resumed[0]["train/policy_version"] == 3, "resume must continue the policy version"

    out = stop_and_check_nothing_is_left(second, signal.SIGINT)
    assert "learning curve" in out


def test_sigterm_stops_like_ctrl_c(tmp_path):
    """kubectl delete or `timeout` send SIGTERM: the run must stop as cleanly as on Ctrl-C."""
    run_dir = tmp_path / "run"
    proc = app(run_dir, "trainer.max_steps=50", "eval.interval=0")
    wait_for_a_train_step(proc, run_dir, 1)
    stop_and_check_nothing_is_left(proc, signal.SIGTERM)
