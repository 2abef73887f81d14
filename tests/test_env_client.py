"""The client layer: restore after a server restart, timeouts, clear errors, local launching."""

import asyncio
import json
import socket
import urllib.request

import pytest
import websockets.asyncio.server

from forge_rl.envs import action_and_observation_types, load_env_class
from apps.blackjack.env import BlackJackAction, BlackJackEnvironment, BlackJackObservation
from forge_rl.rollout.env_client import EnvError, EnvSession, EpisodeAborted
from forge_rl.envs.local import env_url, launch_local

BLACKJACK = "apps.blackjack.env:BlackJackEnvironment"


@pytest.fixture(scope="module")
def server():
    with launch_local(BLACKJACK, max_concurrent_envs=4) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


def seed_with_two_decisions():
    """A deal where a first HIT does not end the hand, so a restart can fall between decisions."""
    env = BlackJackEnvironment()
    for seed in range(1000):
        env.reset(seed=seed)
        if not env.step(BlackJackAction(action="HIT")).done:
            return seed
    raise AssertionError("no such seed in 1000")


def test_reconnect_after_restart_replays_the_episode(server):
    seed = seed_with_two_decisions()

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
            return result.observation, session._client._ws.protocol.extensions
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
        await session._client._ws.close()  # drop the connection under the session
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
        await session._client._ws.close()
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


def test_a_call_the_server_never_answers_times_out():
    async def go():
        async def silent(ws):  # reads every message, answers none
            async for _ in ws:
                pass

        async with websockets.asyncio.server.serve(silent, "127.0.0.1", 0) as silent_server:
            port = silent_server.sockets[0].getsockname()[1]
            session = EnvSession(f"http://127.0.0.1:{port}", timeout_s=0.3, max_restores=1)
            with pytest.raises(EpisodeAborted, match="TimeoutError"):
                await session.reset(seed=1)

    run(go())


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
    assert load_env_class(BLACKJACK) is BlackJackEnvironment
    assert action_and_observation_types(BlackJackEnvironment) == (BlackJackAction, BlackJackObservation)
    with pytest.raises(ValueError, match="must be 'module:Class'"):
        load_env_class("apps.blackjack.env")
    with pytest.raises(ValueError, match="cannot load environment"):
        load_env_class("apps.blackjack.env:NoSuchEnvironment")
    with pytest.raises(TypeError, match="must subclass Environment"):
        action_and_observation_types(dict)


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
    assert health["environment"] == "BlackJackEnvironment" and health["max_concurrent_envs"] == 3
