"""Faults a real cluster has, caused for real: a vLLM engine process killed inside a live Generator
actor, a reference model's process killed. The run's services must survive them (forge_rl/runtime/service.py,
forge_rl/recipes/grpo/faults.py).
"""

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from monarch.actor import ActorError
from safetensors.torch import load_file

from forge_rl.engines.vllm.generator import catch_up
from forge_rl.rollout.sessions import fit_sessions_to_server, server_capacity
from forge_rl.weights import control
from forge_rl.runtime.service import ReplicaDead
from forge_rl.core.config import ConfigError, GeneratorConfig
from forge_rl.envs.local import launch_local
from forge_rl.engines.vllm.generator import Generator
from forge_rl.rollout.sessions import SessionPool
from forge_rl.engines.titan.reference import ReferenceModel
from forge_rl.models.tiny import build_tiny_model
from forge_rl.weights.layout import WeightsHandle

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
BLACKJACK = "apps.blackjack.env:BlackJackEnvironment"
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


async def push(state_dict: dict, version: int) -> None:
    """What Trainer.push_weights does with weight_sync=store: the bytes, then the handle."""
    await control.put_state_dict(state_dict, version)
    await control.put_handle(WeightsHandle("store", version).as_dict(), version)


async def pid_of(replica) -> int:
    return int((await replica.actor._bind_rank.call_one())["pid"])


def engine_core_of(pid: int) -> psutil.Process:
    """The vLLM engine process among a Generator process's children, found by its process title."""
    (engine,) = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    return engine


@pytest.mark.slow  # a minute here, two in CI (the suite keeps under 20): make test-slow runs it
def test_a_generator_whose_vllm_engine_died_is_restarted_caught_up_and_its_calls_retried(tmp_path):
    """kill -9 of VLLM::EngineCore, the Monarch actor alive: its ping says ReplicaDead; a generate that
    meets it is retried on the restarted replica, which has caught up to the newest pushed weights; a
    weight update fanned out meanwhile does not fail; later updates reach the new engine."""
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    original = load_file(path / "model.safetensors")
    zeroed = dict(original, **{"lm_head.weight": torch.zeros_like(original["lm_head.weight"])})
    uniform = -math.log(original["lm_head.weight"].shape[0])  # zero logits: every token equally likely

    async def main():
        await control.start()
        config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
        policy = await Generator.options(num_replicas=1, health_interval_s=3600).as_service(str(path), "float32", config, 0)
        policy.after_restart = catch_up
        try:
            await push(zeroed, 1)
            await policy.fanout("update_weights", 1)
            (before,) = await policy.route("generate", [1, 2, 3], GREEDY)
            assert before.policy_version == 1 and before.logprobs == pytest.approx([uniform] * 4, abs=1e-5)

            replica = policy.replicas[0]
            old_actor, old_pid = replica.actor, await pid_of(replica)
            engine = engine_core_of(old_pid)
            os.kill(engine.pid, signal.SIGKILL)
            engine.wait(10)
            async with asyncio.timeout(60):  # the actor lives on; its health probe says the engine is dead
                while True:
                    try:
                        await old_actor.ping.call_one()
                    except ActorError as e:
                        assert isinstance(e.exception, ReplicaDead), e
                        break
                    await asyncio.sleep(0.2)
            assert replica.healthy, "the service has not probed yet (health_interval_s=3600)"

            await push(dict(original), 2)
            # Both meet the dead engine: the update is left out (no error), the generate is retried on
            # the restarted replica once it has loaded version 2.
            updated, (after,) = await asyncio.gather(
                policy.fanout("update_weights", 2), policy.route("generate", [1, 2, 3], GREEDY)
            )
            assert updated == [] and replica.restarts == 1 and replica.healthy
            assert after.policy_version == 2 and after.logprobs != pytest.approx([uniform] * 4, abs=1e-3)
            new_pid = await pid_of(replica)
            assert new_pid != old_pid and engine_core_of(new_pid).pid != engine.pid

            await push(zeroed, 3)
            assert len(await policy.fanout("update_weights", 3)) == 1
            (last,) = await policy.route("generate", [1, 2, 3], GREEDY)
            assert last.policy_version == 3 and last.logprobs == pytest.approx([uniform] * 4, abs=1e-5)

            # The Generator's whole process killed: its engine and the engine's workers end with it
            # (forge_rl/engines/vllm/plugin.py) and unlink their shared-memory queues; before, they lived on as orphans.
            engine = engine_core_of(new_pid)
            family = [engine, *engine.children(recursive=True)]
            queues = {m.path for p in family for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
            os.kill(new_pid, signal.SIGKILL)
            _, alive = psutil.wait_procs(family, timeout=60)
            assert not alive, f"orphaned vLLM processes: {[(p.pid, p.name()) for p in alive]}"
            assert queues and not [q for q in queues if os.path.exists(q)], "vLLM's queues left in /dev/shm"
        finally:
            await policy.stop()
            await control.stop()

    asyncio.run(main())


def test_a_reference_model_whose_process_died_is_restarted_and_the_call_retried(tmp_path):
    """kill -9 of the only reference replica's process: the next logprobs call waits for the restart
    and returns the same log-probs as before."""
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    ids = [torch.tensor([1, 2, 3, 4, 5])]

    async def main():
        reference = await ReferenceModel.options(num_replicas=1, health_interval_s=3600).as_service(str(path), micro_batch_size=8)
        try:
            (before,) = await reference.route("logprobs", ids)
            pid = await pid_of(reference.replicas[0])
            os.kill(pid, signal.SIGKILL)
            psutil.Process(pid).wait(10)
            (after,) = await reference.route("logprobs", ids)
            assert reference.replicas[0].restarts == 1 and torch.equal(before, after)
        finally:
            await reference.stop()

    asyncio.run(main())


def test_the_session_pool_fits_a_running_server_or_the_run_stops_naming_both_numbers():
    """A server that accepts 6 sessions: a pool asked for 32 holds 6 and plays 24 games at once without
    a refusal; asked for groups of 8 games with env.queue_sessions=false, it cannot, and says why with both
    numbers; with queueing (the default) the same groups share the 6 sessions."""
    with launch_local(BLACKJACK, max_concurrent_envs=6) as server:
        assert fit_sessions_to_server(server.url, 32, 4, 10) == 6
        assert fit_sessions_to_server(server.url, 5, 4, 10) == 5
        with pytest.raises(ConfigError, match=r"accepts 6 sessions .*group_size=8 .*env\.max_concurrent=32: start it with MAX_CONCURRENT_ENVS=32"):
            fit_sessions_to_server(server.url, 32, 8, 10, queue=False)
        assert fit_sessions_to_server(server.url, 32, 8, 10) == 6

        async def play(pool, seed):
            async with pool.session() as session:
                observation = (await session.reset(seed=seed)).observation
                while not observation["done"]:
                    observation = (await session.step({"action": "STAND"})).observation
                return observation["reward"]

        async def many():
            pool = SessionPool(server.url, fit_sessions_to_server(server.url, 32, 4, 10), 30)
            try:
                return await asyncio.gather(*(play(pool, seed) for seed in range(24)))
            finally:
                await pool.close()

        assert len(asyncio.run(many())) == 24
    with pytest.raises(ConfigError, match="does not answer"):
        server_capacity(server.url, 2)


def test_a_pool_larger_than_the_server_fits_itself_to_the_max_sessions_its_refusal_reports():
    """A server of 2 sessions whose size the pool was not told (a server whose /health does not say): the first
    games meet CAPACITY_REACHED, max_sessions 2, and the pool shrinks to 2; from then on its games queue in the
    pool, none at the server (before, 6 of every 8 games waited at the server again, each round)."""
    with launch_local(BLACKJACK, max_concurrent_envs=2) as server:
        async def play(pool, seed):
            async with pool.session() as session:
                waits = session.capacity_waits
                observation = (await session.reset(seed=seed)).observation
                while not observation["done"]:
                    observation = (await session.step({"action": "STAND"})).observation
                return session.capacity_waits - waits

        async def rounds():
            pool = SessionPool(server.url, 8, 30, capacity_wait_s=30)
            try:
                return [sum(await asyncio.gather(*(play(pool, 8 * r + i) for i in range(8)))) for r in range(3)], pool.size
            finally:
                await pool.close()

        waits, size = asyncio.run(rounds())
    assert waits[0] > 0 and waits[1:] == [0, 0] and size == 2, (waits, size)


def test_the_start_up_check_waits_for_a_server_busy_with_another_client(tmp_path):
    """A one-session server held by another client for a second: the reset check waits env.capacity_wait_s as
    the run's games do (it stopped the run with 'refuses reset'); still full after it, it names the key."""
    from forge_rl.core.config import load_config
    from forge_rl.rollout.env_client import EnvSession
    from forge_rl.rollout.sessions import check_reset_args

    with launch_local(BLACKJACK, max_concurrent_envs=1) as server:
        async def check(wait_s: float):
            other = EnvSession(server.url)
            await other.reset(seed=1)
            release = asyncio.get_running_loop().call_later(1.0, lambda: asyncio.ensure_future(other.close()))
            cfg = load_config(ROOT / "configs" / "blackjack_tiny_cpu.yaml", [f"env.url={server.url}", f"env.capacity_wait_s={wait_s}"])
            try:
                await check_reset_args(server.url, cfg)
            finally:
                release.cancel()
                await other.close()

        asyncio.run(check(30))
        with pytest.raises(ConfigError, match=r"^env\.capacity_wait_s: the server at .* stayed full for 0\.2 s"):
            asyncio.run(check(0.2))


def test_an_app_pointed_at_a_small_server_stops_before_launching_anything(tmp_path):
    """`env.url=...` on the command line over a config naming env.server: the URL wins; with
    env.queue_sessions=false a server with fewer sessions than a group's games stops the run at once,
    exit status 2, one line naming both."""
    with launch_local(BLACKJACK, max_concurrent_envs=2) as server:
        proc = subprocess.run(
            [sys.executable, "-m", "forge_rl.grpo", "--config", str(ROOT / "configs" / "blackjack_tiny_cpu.yaml"),
             f"env.url={server.url}", "env.queue_sessions=false", f"run_dir={tmp_path / 'run'}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line and "HYPERACTOR" not in line]
    assert proc.returncode == 2, lines[-20:]
    assert lines[-1].startswith("config error: env.url: ") and "accepts 2 sessions" in lines[-1] and "MAX_CONCURRENT_ENVS=256" in lines[-1], lines
    assert not any("Traceback" in line for line in lines), lines


def _trainer_pid(run_dir: Path, after: int = 0) -> int | None:
    """The pid the trainer's rank 0 logged to run.log (forge_rl.actor._bind_rank), the last one after byte `after`."""
    log = run_dir / "run.log"
    text = log.read_text(errors="replace")[after:] if log.exists() else ""
    found = re.findall(r"forge_rl Trainer: host=\S+ pid=(\d+)", text)
    return int(found[-1]) if found else None


@pytest.mark.slow
def test_a_dead_trainer_stops_the_run_naming_it_and_the_checkpoint_and_restart_on_failure_goes_on(tmp_path):
    """kill -9 of the trainer's process: the run stops within seconds, the last line names the trainer and
    the last checkpoint, and nothing is left behind. Resumed with trainer.restart_on_failure=true, a second
    kill restarts it from its last checkpoint and the run ends its steps, each step logged once."""
    from tests.test_app import app, descendants, leftovers, shared_memory, wait_for_a_train_step
    from forge_rl.recipes.metrics import read_metrics

    run_dir = tmp_path / "run"
    small = ["trainer.max_steps=4", "synchronous=true", "eval.interval=0", "trainer.checkpoint_every=1", "rollout.num_workers=2"]
    shm_before = shared_memory()
    first = app(run_dir, *small)
    wait_for_a_train_step(first, run_dir, 2)
    spawned, pid = descendants(first), _trainer_pid(run_dir)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    out, _ = first.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.strip()]
    assert first.returncode == 1, out[-3000:]
    assert lines[-1].startswith("stopped: the trainer (pid %d on " % pid) and "Last checkpoint: step " in lines[-1], lines[-5:]
    assert "resume=true continues from it" in lines[-1] and "Traceback" not in out, out[-3000:]
    print(f"the run stopped {time.time() - killed_at:.0f} s after the trainer was killed")
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    assert not leftovers(shm_before), f"left behind after the trainer's kill -9: {leftovers(shm_before)}"

    log_size = (run_dir / "run.log").stat().st_size
    second = app(run_dir, *small, "trainer.max_steps=8", "resume=true", "trainer.restart_on_failure=true")
    deadline = time.time() + 600
    while (pid := _trainer_pid(run_dir, log_size)) is None or not any(
        r["step"] >= 5 and "train/loss" in r for r in read_metrics(run_dir)
    ):
        assert second.poll() is None and time.time() < deadline, second.stdout.read()[-3000:]
        time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    out, _ = second.communicate(timeout=900)
    assert second.returncode == 0 and "trainer.restart_on_failure: starting again from step" in out, out[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert steps == list(range(1, 9)), steps
    versions = [r["train/policy_version"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert versions == steps, versions


@pytest.mark.slow  # two vLLM engine starts: minutes on 2 busy cores
@pytest.mark.timeout(1200)
def test_a_generator_restarting_during_a_shm_push_waits_for_it_and_catches_up(tmp_path):
    """The replica's engine dies just as the trainer starts pushing version 2 through shared memory, which
    puts the handle in TorchStore before the bytes are in: the restarted replica's catch-up meets a buffer
    still being written, asks again instead of failing the restart (which left a whole engine running per
    failed attempt, and waited a health interval per attempt), and loads version 2 once the write ends.
    Then version 2 is dropped and its buffer reused while nobody loads it: the next update goes through."""
    import logging

    from forge_rl.weights import shm
    from forge_rl.weights.layout import copy_rows, fused_order

    said = []  # what catch-up and the service log, in this process (Monarch's logging keeps it from caplog)
    recorder = logging.Handler(logging.INFO)
    recorder.emit = lambda record: said.append(record.getMessage())
    for name in ("forge_rl.engines.vllm.generator", "forge_rl.runtime.service"):
        logging.getLogger(name).addHandler(recorder)
        logging.getLogger(name).setLevel(logging.INFO)
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    original = fused_order(load_file(path / "model.safetensors"))
    zeroed = dict(original, **{"lm_head.weight": torch.zeros_like(original["lm_head.weight"])})
    uniform = -math.log(original["lm_head.weight"].shape[0])
    buffers = shm.SharedBuffers()

    async def publish(state_dict, version):
        handle = buffers.write(state_dict, version)
        await control.put_handle(handle.as_dict(), version)

    async def main():
        await control.start()
        config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
        policy = await Generator.options(num_replicas=1, health_interval_s=30).as_service(str(path), "float32", config, 0)
        policy.after_restart = catch_up
        try:
            await publish(zeroed, 1)
            await policy.fanout("update_weights", 1)
            replica = policy.replicas[0]
            engine = engine_core_of(await pid_of(replica))
            os.kill(engine.pid, signal.SIGKILL)
            engine.wait(10)

            handle = buffers.claim(original, 2)  # the trainer's push of version 2 begins: its handle first
            payload = await asyncio.to_thread(buffers.begin, handle)
            await control.put_handle(handle.as_dict(), 2)
            call = asyncio.ensure_future(policy.route("generate", [1, 2, 3], GREEDY))  # meets the dead engine
            async with asyncio.timeout(600):  # the new engine is up and its catch-up has met the unfinished buffer
                while replica.actor is None or not any("not loadable yet" in m for m in said):
                    await asyncio.sleep(0.2)
            copy_rows(payload, handle.layout, ((0, t) for t in original.values()))
            buffers.end(handle, written=True)
            (after,) = await asyncio.wait_for(call, 300)
            assert after.policy_version == 2 and after.logprobs != pytest.approx([uniform] * 4, abs=1e-3)
            assert replica.restarts == 1 and not any("failed to restart" in m for m in said), said
            engines = [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::EngineCore"]
            assert len(engines) == 1, f"engines running for one replica: {[p.pid for p in engines]}"

            await publish(zeroed, 3)  # version 2 dropped, its buffer reused by 4: a fanout of 4 still loads
            await control.delete_version(2)
            await publish(original, 4)
            await policy.fanout("update_weights", 4)
            (last,) = await policy.route("generate", [1, 2, 3], GREEDY)
            assert last.policy_version == 4 and last.logprobs == pytest.approx(after.logprobs, abs=1e-4)  # F.linear or oneDNN
        finally:
            await policy.stop()
            buffers.close()
            await control.stop()
            for name in ("forge_rl.engines.vllm.generator", "forge_rl.runtime.service"):
                logging.getLogger(name).removeHandler(recorder)

    asyncio.run(main())


@pytest.mark.slow  # two engines and a third started mid-run: minutes on 2 cores
@pytest.mark.timeout(1200)
def test_under_broadcast_a_dead_generator_loses_no_step_and_rejoins_at_the_newest_version(tmp_path):
    """Two generator replicas with weight_sync=broadcast; kill -9 of one replica's vLLM engine mid-run. The
    trainer keeps publishing to the survivor (no step lost, no stall: each update reaches one replica),
    the restarted replica forms a group of its own with the trainer, is sent the version the trainer
    holds, and every later version reaches both. With one group for all, the next send failed and so did
    every step after it."""
    from tests.test_app import CONFIG, SMALL, descendants
    from forge_rl.recipes.metrics import read_metrics

    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    with open(console, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forge_rl.grpo", "--config", str(CONFIG), f"run_dir={run_dir}", *SMALL,
             "generator.num_replicas=2", "generator.weight_sync=broadcast", "trainer.max_steps=1000",
             "synchronous=true", "eval.interval=0", "trainer.checkpoint_every=0"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def replicas() -> list[int]:
        return [int(r["weight_sync/replicas"]) for r in read_metrics(run_dir) if "train/loss" in r]

    def wait(condition, what: str, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert proc.poll() is None, f"the run ended while waiting for {what}: " + console.read_text()[-3000:]
            assert time.time() < deadline, f"no {what} within {timeout:.0f} s"
            time.sleep(0.5)

    try:
        wait(lambda: len(replicas()) >= 2, "second step")
        engines = [p for p in descendants(proc) if p.name() == "VLLM::EngineCore"]
        assert len(engines) == 2, engines
        os.kill(engines[0].pid, signal.SIGKILL)
        killed_at = len(replicas())
        wait(lambda: 1 in replicas()[killed_at:], "a step published to the survivor alone")
        wait(lambda: replicas()[-3:] == [2, 2, 2] and 1 in replicas()[killed_at:-3], "three steps reaching both replicas again")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    text = console.read_text()
    records = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "a step lost or repeated"
    assert [r["train/policy_version"] for r in records] == list(range(1, len(records) + 1))
    assert replicas()[:killed_at - 1] == [2] * (killed_at - 1), replicas()  # the step under way may have lost it
    rejoined = re.search(r"generator replica (\d) rejoined the weights broadcast at version (\d+)", text)
    assert rejoined and int(rejoined.group(2)) > killed_at, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
