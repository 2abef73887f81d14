"""The BlackJack app as users run it: `python -m forge_rl.grpo --config ...` in a subprocess, with
real Monarch actors, vLLM, TorchStore and a BlackJack server on loopback.

Run 1 trains five steps (synchronous: generate, then train, at temperature 0.7) and checkpoints; run 2
resumes a copy of it from step 3, must repeat run 1's losses, and is stopped with Ctrl-C mid-run, which
must end it cleanly with no process, shared-memory object or weights file left behind.
"""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from apps.blackjack.task import ACTIONS
from forge_rl.core.config import LoggingConfig
from forge_rl.recipes.grpo.loop import StepsBar
from forge_rl.recipes.metrics import MetricsLogger, read_metrics

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "blackjack_tiny_cpu.yaml"
SMALL = [
    "grpo.batch_size=2", "grpo.group_size=4", "rollout.num_workers=2", "eval.interval=2", "eval.num_games=16",
    "trainer.checkpoint_every=2", "logging.tensorboard=true",
]


def app(run_dir: Path, *overrides: str, sigint_ignored: bool = False, **env: str) -> subprocess.Popen:
    """The app in a subprocess; `sigint_ignored`: as a script's background job starts it (SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "forge_rl.grpo", "--config", str(CONFIG), f"run_dir={run_dir}", *SMALL, *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
    )


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def communicate_watching(proc: subprocess.Popen, timeout: float) -> tuple[str, list[psutil.Process]]:
    """proc.communicate(), and every process it started meanwhile (to check that none outlives it)."""
    spawned, done = {}, threading.Event()

    def watch():
        while not done.is_set():
            spawned.update((p.pid, p) for p in descendants(proc))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        done.set()
        watcher.join()
    return out, list(spawned.values())


def wait_for_a_train_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and not any(r["step"] >= step and "train/loss" in r for r in read_metrics(run_dir)):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)


def stop_and_check_nothing_is_left(proc: subprocess.Popen, sig: int, shm_before: set[str]) -> str:
    """Send `sig` to a running app; it must exit with 130 and take every process it started with it, and
    leave no shared-memory object (`shm_before`: /dev/shm before it started) nor weights file behind."""
    spawned = descendants(proc)
    assert len(spawned) >= 4, "expected the app's actor and engine processes"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in out, out[-3000:]
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, f"processes left behind after {signal.Signals(sig).name}: {[p.cmdline()[:3] for p in alive]}"
    assert not leftovers(shm_before), f"left behind after {signal.Signals(sig).name}: {leftovers(shm_before)}"
    return out


def shared_memory() -> set[str]:
    return set(os.listdir("/dev/shm"))


def leftovers(shm_before: set[str]) -> list[str]:
    """Objects in /dev/shm that appeared since `shm_before` and that no live process has open or mapped,
    twice 5 s apart (so another program's segments in use, or being set up, are not counted), and weights
    files in the temp dir. Called once the run's processes have ended: a multiprocessing semaphore
    (sem.mp-*) left while some multiprocessing resource tracker lives is another program's (a parallel
    test's), which its tracker unlinks when that program ends."""

    def unused() -> set[str]:
        in_use, trackers = set(), False
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                in_use.update(m.path for m in p.memory_maps(grouped=True))
                in_use.update(f.path for f in p.open_files())
                trackers = trackers or "multiprocessing.resource_tracker" in " ".join(p.cmdline())
        new = {name for name in shared_memory() - shm_before if not (trackers and name.startswith("sem.mp-"))}
        return {f"/dev/shm/{name}" for name in new} - in_use

    found = unused()
    if found:
        time.sleep(5)
        found &= unused()
    return sorted(found) + [str(p) for p in Path(tempfile.gettempdir()).glob("forge_rl_weights_*")]


def test_train_checkpoint_resume_and_ctrl_c(tmp_path):
    """Run 1 trains 5 steps and checkpoints at step 3 and at its end; run 2, a copy of its directory sent
    back to step 3, resumes there and must train as run 1 did (synchronous runs are deterministic in their
    seed: the deals follow the data position, each request carries a sampling seed of its deal, prompt and
    count, and a round's groups enter the buffer in seed order), then is stopped with Ctrl-C."""
    run_dir = tmp_path / "run"
    # eval.interval=7 > max_steps: the evaluation at step 5 is the one every run makes of its final policy,
    # and checkpoint_every=3: step 5's checkpoint is the one every run makes at its end. 3 workers for
    # batches of 2 groups: the workers bound how many play at once, the batch how many are played.
    # A constant LR, so that run 2's longer max_steps leaves the schedule alone.
    same = ["synchronous=true", "eval.interval=7", "trainer.checkpoint_every=3", "rollout.num_workers=3",
            "sampling.temperature=0.7", "trainer.optimizer.schedule=constant"]
    shm_before = shared_memory()
    first = app(run_dir, "trainer.max_steps=5", *same)
    out, spawned = communicate_watching(first, timeout=600)
    assert first.returncode == 0, out[-3000:]
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive and not leftovers(shm_before), f"left behind by a run that ended: {alive} {leftovers(shm_before)}"

    rows = read_metrics(run_dir)
    references = rows.pop(0)  # logged once at the start: the reference policies on the eval deals, and the untrained policy
    assert references["step"] == 0 and -1 <= references["eval/reference/basic_strategy"] <= 1
    assert references["eval/games"] == 16 and references["eval/invalid_rate"] == 0 and "eval/ev" in references
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:  # synchronous is on-policy: every group of a step sampled by the weights it trains
        assert row["train/policy_age"] == 0, "a synchronous step trained on data of an older version"
        assert row["buffer/evicted_stale"] == 0 and row["buffer/added"] == 2 * row["step"], "a group played for nothing"
        assert row["train/token_age_mean"] == 0 and row["train/token_age_p90"] == 0, "no trained token is older either"
        # ...so the PPO ratio is 1, at temperature 0.7 too (the trainer scores logits / temperature)
        assert abs(row["train/ratio_max"] - 1) < 1e-3, row["train/ratio_max"]
    last = rows[-1]
    for key in ("train/loss", "train/reward", "train/entropy", "eval/ev", "eval/win", "eval/invalid_rate"):
        assert key in last, key
    assert last["eval/games"] == 16 and last["eval/invalid_rate"] == 0
    win, push, loss = last["eval/win"], last["eval/push"], last["eval/loss"]
    assert abs(win + push + loss - 1) < 1e-9 and all(round(16 * x, 9) == int(round(16 * x)) for x in (win, push, loss))
    assert abs(last["eval/ev"] - (win - loss)) < 1e-9, "a hand returns +1, 0 or -1 (docs/blackjack.md)"
    # the luck-corrected EV: the model's EV less basic strategy's on the same deals, plus its exact EV
    corrected = last["eval/ev"] - references["eval/reference/basic_strategy"] - 0.0428
    assert abs(last["eval/ev_luck_corrected"] - corrected) < 1e-9
    assert last["train/invalid_rate"] == 0, "constrained decoding makes every answer valid"
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert (run_dir / "final/hf/model.safetensors").is_file() and (run_dir / "checkpoints/step_000003/hf/config.json").is_file()
    assert "eval/ev" not in rows[0], "step 1 is neither on eval.interval nor the last step"
    assert "group_size: 4" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "tensorboard").iterdir())
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 5 and latest["version"] == 5 and last["train/policy_version"] == 5

    # Resume a copy from step 3 (a run directory can be moved: checkpoint paths are relative), then Ctrl-C.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    checkpoints = resumed_dir / "checkpoints"
    shutil.copy(checkpoints / "step_000003" / "progress.json", checkpoints / "latest.json")
    metrics = resumed_dir / "metrics.jsonl"  # as if it had stopped after step 3 (the resume drops later rows too)
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if json.loads(line)["step"] <= 3))
    shm_before = shared_memory()
    second = app(resumed_dir, "resume=true", "trainer.max_steps=50", *same)
    wait_for_a_train_step(second, resumed_dir, 5)
    resumed = [r for r in read_metrics(resumed_dir) if r["step"] >= 4 and "train/loss" in r]
    assert resumed[0]["step"] == 4 and resumed[0]["train/policy_version"] == 4, "resume continues step and version"
    out = stop_and_check_nothing_is_left(second, signal.SIGINT, shm_before)
    assert "learning curve" in out

    def trained(rows):
        return {r["step"]: (r["train/loss"], r["train/batch_reward"], r["train/entropy"]) for r in rows if "train/loss" in r}

    straight, again = trained(rows), trained(read_metrics(resumed_dir))
    assert len(set(straight.values())) == 5, "every step trained on other data (else the comparison says little)"
    for step in (4, 5):  # step 4: same weights and data; step 5: the restored optimizer state made the same update
        assert again[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-7), (step, again[step], straight[step])
    rows = read_metrics(resumed_dir)
    assert sum("eval/reference/basic_strategy" in r for r in rows) == 1, "the references are logged once per run_dir"
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == sorted(set(steps)), f"a step logged twice: {steps}"


def test_a_resumed_run_forgets_the_rows_it_logs_again(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False))
    for step in range(1, 5):
        logger.log(step, {"train/loss": float(step)})
        logger.log_samples(step, "train", [{"reward": 1.0, "invalid": False, "turns": []}])
    logger.drop_after(2)  # resumed from the checkpoint of step 2
    logger.log(3, {"train/loss": 30.0})
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2]


def test_bad_app_module_or_env_server_exits_2_with_one_line(tmp_path):
    cases = (("app_module=apps.nope", "app_module 'apps.nope'"), ("env.server=nope.env:Env", "env.server"))
    procs = [app(tmp_path / f"run{i}", override) for i, (override, _) in enumerate(cases)]  # both at once
    for proc, (_, named) in zip(procs, cases):
        out, _ = proc.communicate(timeout=300)
        lines = [line for line in out.splitlines() if "Warning: setting HYPERACTOR" not in line]
        assert proc.returncode == 2 and len(lines) == 1 and named in lines[0] and "config error" in lines[0], out


@pytest.mark.slow  # a minute here, two in CI (the suite keeps under 20): make test-slow runs it
def test_sigterm_stops_like_ctrl_c(tmp_path):
    """kubectl delete or `timeout` send SIGTERM: the run must stop as cleanly as on Ctrl-C, also when a
    script started it in the background (SIGINT ignored, which the SIGTERM handler relies on)."""
    run_dir = tmp_path / "run"
    shm_before = shared_memory()
    proc = app(run_dir, "trainer.max_steps=50", "eval.interval=0", "synchronous=false", sigint_ignored=True)  # rollouts overlap training
    wait_for_a_train_step(proc, run_dir, 1)
    stop_and_check_nothing_is_left(proc, signal.SIGTERM, shm_before)


def test_asynchronous_workers_play_no_group_past_the_next_batch(tmp_path):
    """8 rollout workers, batches of 2 groups: the groups held and playing make at most the next batch, so none
    goes stale unused (before, every worker played on while a batch waited, and step 3 evicted 4 groups)."""
    proc = app(tmp_path / "run", "synchronous=false", "trainer.max_steps=4", "eval.interval=0", "rollout.num_workers=8")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    last = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r][-1]
    assert last["step"] == 4 and last["buffer/evicted_stale"] == 0 and last["buffer/added"] - last["buffer/sampled"] <= 2, last


def test_the_bars_time_estimate_leaves_out_the_first_steps_warm_up():
    """A first step of 2.5 s (warm-up), then steps of 0.15 s: 17 steps left take 2.5 s, not the 8 s or more that a rate
    still weighted by the first step predicts. The elapsed time keeps the warm-up."""
    bar = StepsBar(total=20, file=io.StringIO())
    for seconds in (2.5, 0.15, 0.15, 0.15):
        time.sleep(seconds)
        bar.update(1)
    shown = bar.format_dict
    remaining = (shown["total"] - shown["n"]) / shown["rate"]
    assert shown["n"] == 4 and shown["elapsed"] >= 2.9 and remaining < 5, (remaining, shown["rate"])
    assert "?" not in bar.format_meter(**shown).split("<")[1][:5], "the estimate is shown from the second step"
    bar.close()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, str]:
    """Three steps of two minibatches each, evaluations at steps 0, 2 and 3, training samples every 2 steps,
    W&B offline: the run directory and the console (stdout and stderr)."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    proc = app(run_dir, "trainer.max_steps=3", "trainer.checkpoint_every=0", "logging.samples_every=2", "grpo.minibatches=2",
               "logging.wandb_project=samples", WANDB_MODE="offline", WANDB_SILENT="true")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return run_dir, out


def test_a_run_logs_games_as_text_at_each_evaluation_and_every_samples_every_steps(short_run):
    run_dir, out = short_run
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(s["kind"], s["step"]) for s in samples] == [("eval", 0)] * 3 + [("train", 2)] * 3 + [("eval", 2)] * 3 + [("eval", 3)] * 3
    for sample in samples:
        assert sample["turns"] and sample["reward"] in (-1.0, 0.0, 1.0) and not sample["invalid"], sample
        for turn in sample["turns"]:  # the prompt as the policy read it, its constrained answer, the action made of it
            assert "<|im_start|>" in turn["prompt"] and turn["answer"] in ACTIONS and turn["action"] is not None, turn
    deals = {}  # an evaluation's first prompts, by step
    for s in samples:
        if s["kind"] == "eval":
            deals.setdefault(s["step"], []).append(s["turns"][0]["prompt"])
    assert deals[0] == deals[2] == deals[3], "every evaluation shows the same deals"
    assert out.count("(more: samples.jsonl)") == 3, out[-3000:]  # one under each evaluation line
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    assert b"samples/train" in events.read_bytes() and b"samples/eval" in events.read_bytes()
    tables = sorted(run_dir.glob("wandb/offline-run-*/files/media/table/samples/*.table.json"))
    assert {t.name.split("_")[0] for t in tables} == {"eval", "train"} and "[answer]" in tables[0].read_text(), tables


def test_each_minibatch_is_an_optimizer_step_whose_ratio_the_clip_bounds(short_run):
    """grpo.minibatches=2: two optimizer steps per batch, weights out once. The second trains on answers the
    first step's weights would sample differently, so its ratio leaves 1 and PPO's clip acts; with one step
    per batch the ratio is 1 up to numerics and the clip never acts (as in the steps of the default run)."""
    run_dir, _ = short_run
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "train/loss" in s]
    assert [s["train/optimizer_steps"] for s in steps] == [2, 2, 2] and [s["train/policy_version"] for s in steps] == [1, 2, 3]
    assert max(s["train/clip_fraction"] for s in steps) > 0, [s["train/clip_fraction"] for s in steps]


VLLM_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[|EngineCore|VllmWorker|\(Worker pid=")


def test_nothing_of_vllm_reaches_the_console(short_run):
    """The engine core and its workers are vLLM's child processes of a generator actor: what they print goes to
    run.log with everything the actor processes print, as the README says; the console keeps forge_rl's lines."""
    run_dir, out = short_run
    assert VLLM_LINE.search((run_dir / "run.log").read_text()), "vLLM's processes logged nothing to run.log"
    leaked = [line for line in out.replace("\r", "\n").splitlines() if VLLM_LINE.search(line)]
    assert not leaked, leaked[:5]
