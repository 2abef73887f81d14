"""The client layer: restore after a server restart, timeouts, clear errors, local launching."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import websockets.asyncio.server

from forge_rl.core.rewards import RewardError
from forge_rl.rollout.env_client import EnvCapacityError, EnvError, EnvSession, EnvTimeout, EpisodeAborted
from forge_rl.envs.local import env_url, launch_local, server_python

BLACKJACK = "apps.blackjack.env:BlackJackEnvironment"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    with launch_local(BLACKJACK, max_concurrent_envs=4) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


def seed_with_two_decisions(url):
    """A deal where a first HIT does not end the hand, so a restart can fall between decisions."""
    async def first_hit_goes_on(seed):
        async with EnvSession(url, timeout_s=10) as session:
            await session.reset(seed=seed)
            return not (await session.step({"action": "HIT"})).done

    for seed in range(1000):
        if run(first_hit_goes_on(seed)):
            return seed
    raise AssertionError("no such seed in 1000")


def test_reconnect_after_restart_replays_the_episode(server):
    seed = seed_with_two_decisions(server.url)

    async def go():
        async with EnvSession(server.url, timeout_s=10) as reference:
            await reference.reset(seed=seed)
            await reference.step({"action": "HIT"})
            expected = await reference.step({"action": "STAND"})
        session = EnvSession(server.url, timeout_s=10, reconnect_window_s=60)
        await session.reset(seed=seed)
        await session.step({"action": "HIT"})
        server.proc.kill()  # a crash: no close frame, the session's state is gone with the process
        server.proc.wait()
        await asyncio.to_thread(server.start)
        final = await session.step({"action": "STAND"})
        await session.close()
        return expected, final, session.reconnects

    expected, final, reconnects = run(go())
    assert reconnects == 1
    assert final == expected and final.done


def test_sessions_talk_without_compression_or_a_proxy(server, monkeypatch):
    """Messages are small: no per-message deflate (it cost the controller a tenth of its rollout CPU), and a
    proxy set in the environment is not used to reach a server on loopback."""
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")

    async def play():
        session = EnvSession(server.url, restore="none", reconnect_window_s=2)
        try:
            result = await session.reset(seed=3)
            return result.observation, session._conn.ws.protocol.extensions
        finally:
            await session.close()

    observation, extensions = run(play())
    assert observation["dealer_card"]  # the session works through that proxy setting
    assert extensions == []


def test_unseeded_episode_is_restored_with_the_seed_the_server_drew(server):
    async def go():
        session = EnvSession(server.url, timeout_s=10, reconnect_window_s=60)
        first = await session.reset()
        await asyncio.to_thread(server.restart)  # a graceful restart: the server closes the socket
        final = await session.step({"action": "STAND"})
        await session.close()
        return first, final, session.reconnects

    first, final, reconnects = run(go())
    assert reconnects == 1 and final.done
    assert final.observation["player_cards"] == first.observation["player_cards"]
    assert final.observation["seed"] == first.observation["seed"]


def test_replay_that_diverges_aborts_the_episode(server):
    async def go():
        session = EnvSession(server.url, timeout_s=10)
        await session.reset(seed=3)
        session._last.observation["player_total"] += 1  # as if the restarted server dealt differently
        await session._conn.ws.close()  # drop the connection under the session
        with pytest.raises(EpisodeAborted, match="different observation"):
            await session.step({"action": "STAND"})
        with pytest.raises(EnvError, match="before reset"):  # the aborted episode is over
            await session.step({"action": "STAND"})
        assert not (await session.reset(seed=3)).done  # the session itself is usable again
        await session.close()

    run(go())


def test_restore_none_aborts_on_a_drop(server):
    async def go():
        session = EnvSession(server.url, timeout_s=10, restore="none")
        await session.reset(seed=3)
        await session._conn.ws.close()
        with pytest.raises(EpisodeAborted, match="restore='none'"):
            await session.step({"action": "STAND"})
        await session.close()

    run(go())


def test_unreachable_server_fails_within_the_window_not_a_hang():
    with socket.socket() as listener:  # accepts TCP but never answers the WebSocket handshake
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        session = EnvSession(url, connect_timeout_s=0.3, reconnect_window_s=1.0)
        with pytest.raises(EpisodeAborted, match="could not connect within 1 s"):
            run(session.reset(seed=1))


def test_a_call_the_server_never_answers_times_out_and_is_not_sent_again():
    received = []

    async def go():
        async def silent(ws):  # reads every message, answers none
            async for message in ws:
                received.append(json.loads(message)["type"])

        async with websockets.asyncio.server.serve(silent, "127.0.0.1", 0) as silent_server:
            port = silent_server.sockets[0].getsockname()[1]
            session = EnvSession(f"http://127.0.0.1:{port}", timeout_s=0.3, max_restores=3)
            with pytest.raises(EnvTimeout, match="no answer to a reset within timeout_s=0.3 s"):
                await session.reset(seed=1)
            await asyncio.sleep(0.5)

    run(go())
    assert received.count("reset") == 1  # a timed-out call may still be running there: never sent again


def test_a_reply_whose_reward_is_no_finite_number_is_the_episodes_error():
    """A server that is not OpenEnv's (whose pydantic sends NaN as null) may send NaN, a bool or a string."""
    async def go(reward: str):
        async def server(ws):
            async for message in ws:
                done = json.loads(message)["type"] == "step"
                await ws.send('{"type": "observation", "data": {"observation": {}, "reward": %s, "done": %s}}' % (reward if done else "null", str(done).lower()))

        async with websockets.asyncio.server.serve(server, "127.0.0.1", 0) as ws_server:
            async with EnvSession(f"http://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}", timeout_s=5) as session:
                assert (await session.reset(seed=1)).reward is None
                return await session.step({"action": "HIT"})

    assert run(go("-0.5")).reward == -0.5
    for reward, reason in [("NaN", "reward_not_finite"), ("Infinity", "reward_not_finite"), ("true", "reward_not_a_number"), ('"0.7"', "reward_not_a_number")]:
        with pytest.raises(RewardError, match=f"^{reason}: "):
            run(go(reward))


def test_an_answer_that_is_no_observation_is_an_error_naming_the_servers_openenv():
    """A server of another OpenEnv version may answer in another shape: read as an observation, it was an empty one."""
    async def go(health: dict):
        async def server(ws):
            async for _ in ws:
                await ws.send('{"type": "step_result", "data": {"observation": {}, "reward": null, "done": false}}')

        def answer_health(connection, request):
            if request.path == "/health":
                return connection.respond(200, json.dumps(health))

        async with websockets.asyncio.server.serve(server, "127.0.0.1", 0, process_request=answer_health) as ws_server:
            async with EnvSession(f"http://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}", timeout_s=5) as session:
                await session.reset(seed=1)

    with pytest.raises(EnvError, match=r"answered a reset with a 'step_result' message, not OpenEnv 0\.10's observation; the server runs openenv 0\.11\.0"):
        run(go({"status": "healthy", "openenv": "0.11.0"}))
    with pytest.raises(EnvError, match=r"the server runs openenv \(its /health does not say\)"):
        run(go({"status": "healthy"}))


def test_step_before_reset_and_bad_arguments_are_clear():
    with pytest.raises(EnvError, match="before reset"):
        run(EnvSession("http://127.0.0.1:1").step({"action": "HIT"}))
    with pytest.raises(ValueError, match="restore must be one of"):
        EnvSession("http://127.0.0.1:1", restore="sometimes")
    with pytest.raises(ValueError, match="exactly one of url"):
        env_url()
    with pytest.raises(ValueError, match="exactly one of url"):
        env_url(url="http://x", server=BLACKJACK)
    assert env_url(url="http://blackjack:8000") == ("http://blackjack:8000", None)


def test_loading_environment_classes():
    """In the server virtualenv (the classes import openenv 0.10, which the training one lacks)."""
    probe = """
from forge_rl.envs import action_and_observation_types, load_env_class
from apps.blackjack.env import BlackJackAction, BlackJackEnvironment, BlackJackObservation
assert load_env_class("apps.blackjack.env:BlackJackEnvironment") is BlackJackEnvironment
assert action_and_observation_types(BlackJackEnvironment) == (BlackJackAction, BlackJackObservation)
for target, error, words in (("apps.blackjack.env", ValueError, "must be 'module:Class'"),
                             ("apps.blackjack.env:NoSuchEnvironment", ValueError, "cannot load environment")):
    try:
        load_env_class(target)
    except error as e:
        assert words in str(e), e
    else:
        raise AssertionError(target)
try:
    action_and_observation_types(dict)
except TypeError as e:
    assert "must subclass Environment" in str(e)
else:
    raise AssertionError("dict")
"""
    done = subprocess.run([server_python(), "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_training_side_imports_no_openenv():
    """The run's modules, the client and the config check load with openenv (and MCP) made unimportable: the
    training virtualenv needs neither (openenv 0.10 cannot be installed beside vLLM 0.32)."""
    probe = """
import sys
for name in ("openenv", "openenv_core", "fastmcp", "mcp"):
    sys.modules[name] = None
import forge_rl.recipes.grpo.main, forge_rl.rollout.env_client, forge_rl.recipes.grpo.check, forge_rl.envs.local
import apps.blackjack.task, apps.coder.task
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_missing_server_virtualenv_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^env\.server_python: no python at .*; run `make install`"):
        launch_local(BLACKJACK, python=str(tmp_path / "bin" / "python"))
    assert server_python().endswith(".venv-env/bin/python")


def test_a_full_server_is_waited_for_not_a_lost_game():
    """A one-session server: a second session waits (capacity_wait_s) while the first plays, and gets the slot
    once the first closes; without waiting it is refused at once, with the server's max_sessions."""
    with launch_local(BLACKJACK, max_concurrent_envs=1) as one:
        async def go():
            first = EnvSession(one.url)
            await first.reset(seed=1)
            with pytest.raises(EnvCapacityError) as refused:
                await EnvSession(one.url, capacity_wait_s=0).reset(seed=2)
            assert refused.value.max_sessions == 1
            second = EnvSession(one.url, capacity_wait_s=30)
            waiting = asyncio.ensure_future(second.reset(seed=2))
            await asyncio.sleep(1.0)
            assert not waiting.done() and second.capacity_waits > 0
            await first.close()  # the game ended: its session is closed and the slot is free
            result = await asyncio.wait_for(waiting, 30)
            await second.close()
            return result

        assert not run(go()).done


def test_launch_local_reports_a_server_that_dies():
    with pytest.raises(RuntimeError, match="cannot load environment"):
        launch_local("apps.blackjack.env:NoSuchEnvironment", timeout_s=30)


def test_env_url_launches_a_config_server():
    url, local = env_url(server=BLACKJACK, max_concurrent=2)
    try:
        async def go():
            async with EnvSession(url) as session:
                return await session.reset(seed=0)

        assert not run(go()).done
    finally:
        local.stop()


def test_module_entry_point_reads_max_concurrent_envs():
    """`python -m apps.blackjack.env` is what Kubernetes runs; it honours MAX_CONCURRENT_ENVS."""
    with launch_local("apps.blackjack.env", max_concurrent_envs=3) as srv:
        health = json.load(urllib.request.urlopen(f"{srv.url}/health", timeout=5))
    assert health["environment"] == "BlackJackEnvironment" and health["max_concurrent_envs"] == 3 and health["openenv"] == "0.10.0"
