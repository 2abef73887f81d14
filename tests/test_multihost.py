"""Several hosts on one machine: two `python -m forge_rl.worker` processes on 127.0.0.2 and 127.0.0.3
stand for two machines (docs/multihost.md). A trainer spanning both computes what one on a single host
does; a GRPO run places its trainer on both and its generator on one; a worker killed mid-run is named
and the run stops, without hanging.

Each run is a subprocess: Monarch's transport is fixed once per process (tcp on loopback here, since
this machine's name resolves to 127.0.0.1), so these runs cannot share the test process's Monarch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_rl.core.config import ConfigError, load_config
from forge_rl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
# Monarch stops a worker's processes whose controller has not been heard from for its
# mesh_orphan_timeout (1 minute); on a machine this loaded a niced controller can be starved that long.
ENV = {"HYPERACTOR_MESH_ORPHAN_TIMEOUT": "15m", **os.environ, "PYTHONPATH": str(ROOT)}
# Small enough for a couple of minutes on 2 cores: 4 groups of 4 games per step, no evaluation.
SMALL_RUN = ["grpo.batch_size=4", "rollout.num_workers=4", "eval.interval=0", "trainer.checkpoint_every=0"]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class Workers:
    """`python -m forge_rl.worker` on each address, each with its own log; killed at the end."""

    def __init__(self, addresses: list[str], log_dir: Path):
        self.urls, self.procs = [], []
        for address in addresses:
            port = free_port(address)
            log = open(log_dir / f"worker-{address}.log", "w")
            command = [sys.executable, "-m", "forge_rl.worker", "--host", address, "--port", str(port)]
            self.procs.append(subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"tcp://{address}:{port}")
        for url, proc in zip(self.urls, self.procs):
            host, port = url[len("tcp://") :].split(":")
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, f"worker {url} exited with {proc.returncode}"
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"worker {url} not listening after 60 s"
                    time.sleep(0.2)

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(["127.0.0.2", "127.0.0.3"], tmp_path_factory.mktemp("workers"))
    yield w
    w.stop()


def grpo(run_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "forge_rl.grpo", "--config", "configs/blackjack_tiny_cpu.yaml", f"run_dir={run_dir}"]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen([*command, *SMALL_RUN, *overrides], cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.hosts=2"], "trainer.hosts: 2 hosts need cluster.workers or cluster.kubernetes"),
        (["cluster.workers=[127.0.0.2:26600]"], "cluster.workers: '127.0.0.2:26600' is not of the form tcp://host:port"),
        (["cluster.workers=[tcp://a:1]", "generator.hosts=2"], "generator.hosts: 2, but cluster.workers lists 1"),
        (["cluster.workers=[tcp://a:1]", "cluster.kubernetes.namespace=x"], "set cluster.workers or cluster.kubernetes, not both"),
        (["cluster.transport=udp"], "cluster.transport: expected one of 'auto', 'hostname', 'localhost'"),
    ],
)
def test_bad_cluster_config_is_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ROOT / "configs/blackjack_tiny_cpu.yaml", overrides)


RANK_LINE = re.compile(r"forge_rl Trainer: host=(\S+) pid=\d+ RANK=(\d+) WORLD_SIZE=(\d+) LOCAL_RANK=(\d+) MASTER_ADDR=(\S+)")


def run_script_on_workers(script: str, tmp_path, workers) -> dict:
    """A tests/ script driving the tiny model across the two workers; its last stdout line, as JSON."""
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    out = subprocess.run(
        [sys.executable, script, str(model_dir), *workers.urls],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes on a quiet machine; far more on a loaded one, never a hang
def test_trainer_on_two_hosts_matches_one_host(workers, tmp_path):
    result = run_script_on_workers("tests/multihost_trainer.py", tmp_path, workers)
    ranks = sorted((r["host"], r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"], r["MASTER_ADDR"]) for r in result["ranks"])
    assert ranks == [("127.0.0.2", "0", "2", "0", "127.0.0.2"), ("127.0.0.3", "1", "2", "0", "127.0.0.2")]
    (first, first_b), (second, _) = result["two_hosts"]
    assert first == first_b  # both ranks report the step FSDP2 computed together
    one_first, one_second = result["one_host"]
    for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
        assert first[key] == pytest.approx(one_first[key], rel=1e-5, abs=1e-7), key
        assert second[key] == pytest.approx(one_second[key], rel=1e-3), key  # after an update: float noise only


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_weights_cross_hosts_by_broadcast_bit_exact(workers, tmp_path):
    """Trainer on 127.0.0.2, a generator replica on 127.0.0.3: auto picks the broadcast, over gloo bound to
    the addresses the hosts' agents report, and the served log-probs are bit-exact after the update."""
    r = run_script_on_workers("tests/multihost_weights.py", tmp_path, workers)
    assert r["plan"] == ["broadcast", "127.0.0.2", ["127.0.0.3"]]
    assert (r["trainer_where"], r["generator_where"]) == ("127.0.0.2", "127.0.0.3")
    assert r["zeros"] != r["original"]  # the all-zero update took effect, so the next one has work to do
    assert r["handle_kind"] == "broadcast" and r["version"] == 2
    assert r["broadcast"] == r["original"]  # bit-exact
    assert "127.0.0.3" in r["generator_addresses"], r  # the vLLM worker's gloo pair binds its host's address


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_run_spans_two_hosts_and_matches_one_host(workers, tmp_path):
    """The trainer on both workers, the generator on the first: the run's losses are those of the same run
    on one host (same seed: the deals and every request's sampling seed are the same, so the only
    difference is FSDP2's sum of two ranks' gradients, float noise)."""
    run = grpo(tmp_path / "run", f"cluster.workers=[{','.join(workers.urls)}]", "trainer.hosts=2", "trainer.procs=1", "trainer.max_steps=2")
    try:
        assert run.wait(timeout=1000) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        run.kill()
    log = (tmp_path / "run.log").read_text()
    assert "done: 2 steps" in log
    trainer_ranks = sorted(RANK_LINE.findall(log))
    assert trainer_ranks == [("127.0.0.2", "0", "2", "0", "127.0.0.2"), ("127.0.0.3", "1", "2", "0", "127.0.0.2")], log[-3000:]
    assert re.search(r"forge_rl Generator: host=127\.0\.0\.2 ", log), "the generator takes the first worker"

    single = grpo(tmp_path / "single", "trainer.max_steps=2")
    try:
        assert single.wait(timeout=600) == 0, (tmp_path / "single.log").read_text()[-4000:]
    finally:
        single.kill()
    two_hosts, one_host = losses(tmp_path / "run"), losses(tmp_path / "single")
    assert len(two_hosts) == 2 and two_hosts == pytest.approx(one_host, rel=1e-3), (two_hosts, one_host)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killed_worker_is_named_and_the_run_stops(tmp_path):
    doomed = Workers(["127.0.0.4", "127.0.0.5"], tmp_path)
    run = grpo(tmp_path / "run", f"cluster.workers=[{','.join(doomed.urls)}]", "trainer.hosts=2", "trainer.max_steps=1000")
    try:
        deadline = time.monotonic() + 1200
        while not losses(tmp_path / "run"):  # training is under way on both hosts
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no train step within 1200 s"
            time.sleep(1)
        doomed.procs[1].send_signal(signal.SIGKILL)  # the worker of 127.0.0.5, trainer rank 1
        killed = time.monotonic()
        returncode = run.wait(timeout=400)  # detection, then a bounded shutdown: never a hang
        print(f"stopped {time.monotonic() - killed:.0f} s after the kill")
    finally:
        run.kill()
        doomed.stop()
    log = (tmp_path / "run.log").read_text()
    assert returncode not in (0, None), log[-4000:]
    message = f"lost host {doomed.urls[1]} (127.0.0.5), which ran Trainer ranks 1-1 of 2"
    assert message in log, log[-4000:]
    assert "lost host " + doomed.urls[0] not in log  # the surviving worker is not blamed
