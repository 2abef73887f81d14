"""Service and actor layer with real Monarch processes: routing, stickiness, faults, errors, timeouts."""

import asyncio
import os
import signal
from collections import Counter

import pytest
from monarch.actor import ActorError

from forge_rl.actor import stop
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


def test_replica_that_exits_during_a_call_is_retried_elsewhere():
    async def main():
        service = await EchoActor.options(num_replicas=2, health_interval_s=60).as_service("exits")
        try:
            # `die` kills whichever replica runs it; the retry kills the other one too, so the call fails,
            # but with an error, and both replicas come back.
            with pytest.raises(Exception):
                await service.route("die")
            await service.wait_healthy(timeout=60)
            assert (await service.route("whoami"))[0] == "exits"
        finally:
            await service.stop()

    run(main())


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
