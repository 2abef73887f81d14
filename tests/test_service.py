"""Service and actor layer with real Monarch processes: routing, stickiness, faults, errors, timeouts."""

import asyncio
import os
import signal
from collections import Counter

import psutil
import pytest
from monarch.actor import ActorError

from forge_rl.runtime.actor import call, start_all, stop
from tests.service_actors import EchoActor


def run(coro):
    return asyncio.run(coro)


def test_as_actor_runs_setup_and_sets_distributed_env():
    async def main():
        actor = await EchoActor.options(procs=2).as_actor("solo")
        try:
            tags = [v for _, v in (await actor.whoami.call()).items()]
            envs = [v for _, v in (await actor.env.call()).items()]
        finally:
            await stop(actor)
        assert all(ready for _, _, ready in tags), "setup() was not run on every rank"
        assert len({pid for _, pid, _ in tags}) == 2 and os.getpid() not in {pid for _, pid, _ in tags}
        assert sorted(e["RANK"] for e in envs) == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"} and len({e["MASTER_PORT"] for e in envs}) == 1

    run(main())


def test_route_spreads_calls_and_sessions_stick():
    async def main():
        service = await EchoActor.options(num_replicas=2).as_service("svc")
        try:
            pids = Counter([(await service.route("whoami"))[1] for _ in range(10)])
            assert len(pids) == 2 and min(pids.values()) >= 4, f"round robin is uneven: {pids}"
            for session in ("a", "b", "c"):
                seen = {(await service.route("whoami", session=session))[1] for _ in range(5)}
                assert len(seen) == 1, f"session {session} moved between replicas: {seen}"
            everyone = await service.fanout("whoami")
            assert {pid for _, pid, _ in everyone} == set(pids)
        finally:
            await service.stop()

    run(main())


def test_least_loaded_prefers_idle_replica():
    async def main():
        service = await EchoActor.options(num_replicas=2, policy="least_loaded", call_timeout_s=30).as_service("ll")
        try:
            busy = asyncio.create_task(service.route("hang"))
            await asyncio.sleep(0.5)
            busy_replica = next(r for r in service.replicas if r.in_flight == 1)
            idle_pid = {(await service.route("whoami"))[1] for _ in range(4)}
            busy_pid = (await service._call(busy_replica, "whoami", (), {}, 10))[1]
            assert busy_pid not in idle_pid and len(idle_pid) == 1
            busy.cancel()
        finally:
            await service.stop()

    run(main())


def test_killed_replica_is_detected_restarted_and_calls_succeed():
    async def main():
        service = await EchoActor.options(num_replicas=2, health_interval_s=0.5).as_service("faults")
        try:
            victim = service.replicas[0]
            _, pid, _ = await service._call(victim, "whoami", (), {}, 10)
            os.kill(pid, signal.SIGKILL)
            # The next calls all succeed: the dead replica is noticed (by the call or the health loop),
            # the failed call is retried on the healthy one, and no call reaches the dead process again.
            for _ in range(6):
                tag, new_pid, _ = await service.route("whoami")
                assert tag == "faults" and new_pid != pid
            await service.wait_healthy(timeout=60)
            assert victim.restarts == 1
            pids = {(await service.route("whoami"))[1] for _ in range(6)}
            assert len(pids) == 2 and pid not in pids, "the restarted replica does not take calls"
        finally:
            await service.stop()

    run(main())


def test_replica_that_exits_during_a_call_is_retried_elsewhere(tmp_path):
    async def main():
        service = await EchoActor.options(num_replicas=2, health_interval_s=60).as_service("exits")
        try:
            # The first replica to run `die_if_first` exits; the retry on the other one answers.
            pid = await service.route("die_if_first", str(tmp_path / "died"))
            died = int((tmp_path / "died").read_text())
            assert pid != died and pid in {(await service.route("whoami"))[1] for _ in range(4)}
            await service.wait_healthy(timeout=60)
            assert sum(r.restarts for r in service.replicas) == 1
        finally:
            await service.stop()

    run(main())


def test_health_loop_checks_replicas_at_once_and_outlives_any_error():
    """Replica 0's probe hangs and replica 1's raises; replica 2 is killed: the health loop still
    finds it within a few intervals, not after replica 0's call timeout, and no call is needed."""
    async def main():
        service = await EchoActor.options(num_replicas=3, health_interval_s=0.3, call_timeout_s=120).as_service("probe")
        try:
            hangs, raises, victim = service.replicas
            await service._call(hangs, "set_ping", ("hang",), {}, 10)
            await service._call(raises, "set_ping", ("raise",), {}, 10)
            await asyncio.sleep(1.0)  # a few rounds of probes meet both
            assert service._health_task is not None and not service._health_task.done()
            _, pid, _ = await service._call(victim, "whoami", (), {}, 10)
            os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(20):
                while victim.healthy:
                    await asyncio.sleep(0.1)
            assert raises.healthy, "an exception raised by a probe says nothing about the replica's processes"
        finally:
            await service.stop()

    run(main())


def test_a_failed_start_stops_what_did_start(tmp_path):
    """One replica's setup fails: as_service raises it and the replica that started is stopped; the
    same for start_all over an actor and a service."""
    async def main():
        with pytest.raises(ActorError, match="on purpose"):
            await EchoActor.options(num_replicas=2).as_service("half", str(tmp_path / "svc"))
        survivor = int((tmp_path / "svc").read_text())
        (tmp_path / "taken").write_text("0")  # whoever is given this path fails its setup
        with pytest.raises(ActorError, match="on purpose"):
            await start_all(
                EchoActor.options().as_actor("actor", str(tmp_path / "actor")),
                EchoActor.options(num_replicas=1).as_service("service", str(tmp_path / "service")),
                EchoActor.options().as_actor("fails", str(tmp_path / "taken")),
            )
        return survivor, int((tmp_path / "actor").read_text()), int((tmp_path / "service").read_text())

    for pid in run(main()):
        assert _gone(pid), f"process {pid} of a failed start is still running"


def test_call_returns_rank_0s_value_and_a_hang_names_actor_and_endpoint():
    async def main():
        actor = await EchoActor.options(procs=2).as_actor("timed")
        try:
            tag, pid, _ = await call(actor, "whoami", timeout_s=30)
            assert tag == "timed" and pid != os.getpid()
            with pytest.raises(TimeoutError, match=r"EchoActor\.hang did not return within 0\.5 s"):
                await call(actor, "hang", timeout_s=0.5)
        finally:
            await stop(actor)

    run(main())


def _gone(pid: int, timeout_s: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_actor_exception_reraises_with_remote_traceback():
    async def main():
        service = await EchoActor.options(num_replicas=1).as_service("errors")
        try:
            with pytest.raises(ActorError) as info:
                await service.route("fail", "bad move 42")
            assert "bad move 42" in str(info.value) and "ValueError" in str(info.value)
            assert "service_actors.py" in str(info.value), "the remote traceback is missing"
            assert service.replicas[0].healthy, "an actor exception must not mark the replica dead"
            assert (await service.route("whoami"))[0] == "errors"
        finally:
            await service.stop()

    run(main())


def test_hanging_call_times_out():
    async def main():
        service = await EchoActor.options(num_replicas=1, call_timeout_s=1.0).as_service("hangs")
        try:
            with pytest.raises(TimeoutError, match="hang"):
                await service.route("hang")
            with pytest.raises(TimeoutError):
                await service.fanout("hang", timeout=0.5)
            assert (await service.route("whoami"))[0] == "hangs"
        finally:
            await service.stop()

    run(main())



def test_replica_dead_from_a_call_a_fanout_or_a_probe_restarts_the_replica(tmp_path):
    """An actor whose processes live but which raises ReplicaDead (a Generator whose vLLM engine died):
    a route that meets it is retried on a healthy replica, a fanout leaves it out instead of failing,
    a probe that meets it marks it dead; each time the replica is restarted in new processes."""
    async def main():
        service = await EchoActor.options(num_replicas=2, health_interval_s=0.3).as_service("engines")
        try:
            pids = {(await service._call(r, "whoami", (), {}, 10))[1] for r in service.replicas}
            answered = await service.route("dead_engine_if_first", str(tmp_path / "route"))
            died = int((tmp_path / "route").read_text())
            assert answered in pids and answered != died
            await service.wait_healthy(timeout=60)
            assert sum(r.restarts for r in service.replicas) == 1 and _gone(died), "not restarted in a new process"

            results = await service.fanout("dead_engine_if_first", str(tmp_path / "fanout"))
            assert len(results) == 1, f"a fanout that met a dead replica returns the others' results: {results}"
            await service.wait_healthy(timeout=60)
            assert sum(r.restarts for r in service.replicas) == 2

            victim = service.replicas[1]
            before = victim.restarts  # 1 if the fanout's dead replica was this one
            await service._call(victim, "set_ping", ("dead",), {}, 10)
            async with asyncio.timeout(20):
                while victim.restarts == before or not victim.healthy:
                    await asyncio.sleep(0.1)
            assert sum(r.restarts for r in service.replicas) == 3
        finally:
            await service.stop()

    run(main())


def test_the_only_replica_dead_waits_for_its_restart_and_the_call_is_retried_on_it(tmp_path):
    """With one replica (the default generator and reference services), a call that finds it dead is
    retried once it has been restarted, instead of failing for want of a healthy replica."""
    async def main():
        service = await EchoActor.options(num_replicas=1, health_interval_s=60).as_service("alone")
        try:
            pid = await service.route("dead_engine_if_first", str(tmp_path / "dead"))
            assert pid != int((tmp_path / "dead").read_text()) and service.replicas[0].restarts == 1
            _, pid, _ = await service.route("whoami")
            os.kill(pid, signal.SIGKILL)
            _, new_pid, _ = await service.route("whoami")
            assert new_pid != pid and service.replicas[0].restarts == 2
        finally:
            await service.stop()

    run(main())


def test_a_restart_whose_after_restart_fails_stops_the_mesh_it_made():
    """after_restart (a generator's catch-up) fails twice, then succeeds: each failed attempt's processes
    are stopped before the next attempt makes new ones (before, each one was left running: a whole vLLM
    engine per failed catch-up), and the third attempt's replica takes calls."""
    async def main():
        service = await EchoActor.options(num_replicas=1, health_interval_s=0.2).as_service("catch_up")
        attempts = []

        async def after_restart(replica):
            attempts.append((await replica.actor.whoami.call_one())[1])
            if len(attempts) < 3:
                raise RuntimeError("catch-up failed on purpose")

        service.after_restart = after_restart
        try:
            _, pid, _ = await service.route("whoami")
            os.kill(pid, signal.SIGKILL)
            _, new_pid, _ = await service.route("whoami")
            await service.wait_healthy(timeout=60)
            return pid, new_pid, attempts, service.replicas[0].restarts
        finally:
            await service.stop()

    pid, new_pid, attempts, restarts = run(main())
    assert len(attempts) == 3 and new_pid == attempts[-1] and restarts == 1
    _, alive = psutil.wait_procs([psutil.Process(p) for p in attempts[:2] if psutil.pid_exists(p)], timeout=30)
    assert not alive, f"the meshes of the failed attempts still run: {[p.pid for p in alive]}"
