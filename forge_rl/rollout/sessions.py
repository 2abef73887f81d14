"""The run's environment sessions: a pool of open WebSocket sessions reused game after game; the check that a
running server accepts as many as the pool will hold, the sizes of the task splits the config names, and that it
accepts the config's reset arguments."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request

from forge_rl.core.config import ConfigError
from forge_rl.core.errors import first_line
from forge_rl.rollout.env_client import EnvCapacityError, EnvError, EnvSession
from forge_rl.rollout.wire import task_split_size

logger = logging.getLogger(__name__)


class SessionPool:
    """At most `size` sessions, each reused game after game (a connection per game would cost more than the game);
    one that raised is closed. Sized to what the server accepts, so even a one-session server serves a whole run;
    a server reporting fewer (CAPACITY_REACHED's max_sessions) shrinks the pool as games end."""

    def __init__(self, url: str, size: int, timeout_s: float, capacity_wait_s: float = 0.0):
        self.url, self.timeout_s, self.capacity_wait_s = url, timeout_s, capacity_wait_s
        self.size, self.retiring = size, 0  # slots held; slots to give up as games end
        self.free: asyncio.Queue = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(None)  # a slot without a session yet

    def fit(self, max_sessions: int | None) -> None:
        if max_sessions and max_sessions < self.size:
            logger.warning("the server at %s holds %d sessions (CAPACITY_REACHED), fewer than the pool's %d: the pool holds %d",
                           self.url, max_sessions, self.size, max_sessions)  # fmt: skip
            self.retiring, self.size = self.retiring + self.size - max_sessions, max_sessions

    @contextlib.asynccontextmanager
    async def session(self):
        session = await self.free.get()
        if session is None:
            session = EnvSession(self.url, timeout_s=self.timeout_s, capacity_wait_s=self.capacity_wait_s)
            session.on_full = self.fit
        try:
            yield session
        except BaseException:
            broken, session = session, None
            await broken.close()
            raise
        finally:
            if self.retiring:
                self.retiring -= 1
                if session is not None:
                    await session.close()
            else:
                self.free.put_nowait(session)

    async def close(self) -> None:
        while not self.free.empty():
            session = self.free.get_nowait()
            if session is not None:
                await session.close()


def server_capacity(url: str, timeout_s: float) -> int | None:
    """From /health's `max_concurrent_envs` (forge_rl's servers report it); None when it does not say."""
    health_url = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s) as response:
            health = json.loads(response.read() or b"{}")
    except (OSError, ValueError) as e:
        raise ConfigError(f"env.url: {health_url} does not answer ({e}); is the environment server running?") from None
    capacity = health.get("max_concurrent_envs") if isinstance(health, dict) else None
    return int(capacity) if isinstance(capacity, int) and capacity > 0 else None


def fit_sessions_to_server(url: str, wanted: int, group_size: int, timeout_s: float, queue: bool = True) -> int:
    """`wanted` or the server's smaller capacity. A server that cannot hold one group's games at once stops the
    run here, before anything is launched, unless `queue` (env.queue_sessions)."""
    capacity = server_capacity(url, timeout_s)
    if capacity is None or capacity >= wanted:
        return wanted
    if capacity < group_size and not queue:
        raise ConfigError(
            f"env.url: the server at {url} accepts {capacity} sessions (its /health max_concurrent_envs), fewer than "
            f"one group's grpo.group_size={group_size} games and env.max_concurrent={wanted}: start it with "
            f"MAX_CONCURRENT_ENVS={wanted} (or --max-concurrent-envs {wanted}), or set env.max_concurrent and "
            f"grpo.group_size to at most {capacity}, or env.queue_sessions=true to queue a group's games"
        )
    logger.warning(
        "env.max_concurrent is %d but the server at %s accepts %d sessions (its /health): the run holds at most %d; "
        "start the server with MAX_CONCURRENT_ENVS=%d to play more games at once", wanted, url, capacity, capacity, wanted,
    )
    return capacity


def task_split_sizes(url: str, cfg) -> dict[str, int]:
    """{split: its number of tasks} for env.task_split and each of eval.task_split."""
    sizes = {}
    for key, split in [("env.task_split", cfg.env.task_split)] + [("eval.task_split", s) for s in cfg.eval.splits]:
        if split is None or split in sizes:
            continue
        try:
            size, splits = task_split_size(url, split, cfg.env.timeout_s)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{key}: {first_line(e)}") from None
        if not size:
            what = "has no tasks" if size == 0 else f"is not a split of the server at {url} (it has: {', '.join(splits) or 'none'})"
            raise ConfigError(f"{key}: {split!r} {what}")
        sizes[split] = size
    return sizes


async def check_reset_args(url: str, cfg) -> None:
    """Reset once with each set of arguments the run will send: a refusal stops the run before it trains,
    instead of losing every group to the same error."""
    def on_first_task(arguments: dict, split: str | None) -> dict:
        return {**arguments, "split": split, "index": 0} if split else arguments

    checks = [("env.reset_args", on_first_task(cfg.env.reset_args, cfg.env.task_split))]
    if cfg.eval.interval:
        evaluation = {**cfg.env.reset_args, **cfg.eval.reset_args}
        checks += [("eval.reset_args", on_first_task(evaluation, split)) for split in cfg.eval.splits]
    async with EnvSession(url, timeout_s=cfg.env.timeout_s, restore="none", capacity_wait_s=cfg.env.capacity_wait_s) as session:
        for key, arguments in checks:
            try:
                await session.reset(seed=cfg.seed, **arguments)
            except EnvCapacityError as e:  # another client's sessions fill it: no answer about the arguments
                raise ConfigError(f"env.capacity_wait_s: the server at {url} stayed full for {cfg.env.capacity_wait_s:g} s: {first_line(e)}") from None
            except EnvError as e:
                raise ConfigError(f"{key}: the server at {url} refuses reset({arguments}): {first_line(e)}") from None
