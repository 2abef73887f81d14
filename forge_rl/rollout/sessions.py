"""The run's environment sessions: a pool of open WebSocket sessions reused game after game, and the check
that a running server accepts as many as the pool will hold."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request

from forge_rl.core.config import ConfigError
from forge_rl.rollout.env_client import EnvSession

logger = logging.getLogger(__name__)


class SessionPool:
    """At most `size` environment sessions, each kept open and reused for one game after another
    (a WebSocket connection per game would cost more than the game). A session that raised out of a
    game is closed, not reused."""

    def __init__(self, url: str, size: int, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.free: asyncio.Queue = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(None)  # a slot without a session yet

    @contextlib.asynccontextmanager
    async def session(self):
        session = await self.free.get() or EnvSession(self.url, timeout_s=self.timeout_s)
        try:
            yield session
        except BaseException:
            broken, session = session, None
            await broken.close()
            raise
        finally:
            self.free.put_nowait(session)

    async def close(self) -> None:
        while not self.free.empty():
            session = self.free.get_nowait()
            if session is not None:
                await session.close()


def server_capacity(url: str, timeout_s: float) -> int | None:
    """The sessions the server at `url` accepts, from its /health (`max_concurrent_envs`, which forge_rl's
    servers report); None when it does not say. ConfigError if /health does not answer."""
    health_url = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s) as response:
            health = json.loads(response.read() or b"{}")
    except (OSError, ValueError) as e:
        raise ConfigError(f"env.url: {health_url} does not answer ({e}); is the environment server running?") from None
    capacity = health.get("max_concurrent_envs") if isinstance(health, dict) else None
    return int(capacity) if isinstance(capacity, int) and capacity > 0 else None


def fit_sessions_to_server(url: str, wanted: int, group_size: int, timeout_s: float) -> int:
    """How many sessions the run's pool may hold against the server at `url`: `wanted` (env.max_concurrent),
    or the server's capacity when that is smaller, said once. A server that cannot hold one group's games
    at once stops the run here, before anything is launched, naming both numbers and both fixes."""
    capacity = server_capacity(url, timeout_s)
    if capacity is None or capacity >= wanted:
        return wanted
    if capacity < group_size:
        raise ConfigError(
            f"env.url: the server at {url} accepts {capacity} sessions (its /health max_concurrent_envs), fewer than "
            f"one group's grpo.group_size={group_size} games and env.max_concurrent={wanted}: start it with "
            f"MAX_CONCURRENT_ENVS={wanted} (or --max-concurrent-envs {wanted}), or set env.max_concurrent and "
            f"grpo.group_size to at most {capacity}"
        )
    logger.warning(
        "env.max_concurrent is %d but the server at %s accepts %d sessions (its /health): the run holds at most %d; "
        "start the server with MAX_CONCURRENT_ENVS=%d to play more games at once", wanted, url, capacity, capacity, wanted,
    )
    return capacity
