"""What a run does when one of its parts fails: the handling that is neither a service's (forge_rl/service.py
restarts replicas) nor the training loop's.

- `catch_up`: a restarted generator replica starts from the model directory (version 0); it loads the
  newest version the trainer has pushed, again until no newer one appeared meanwhile, before it takes calls.
- `fit_sessions_to_server`: the run's pool of environment sessions never asks a server for more sessions
  than it accepts (a full server refuses the next one with EnvCapacityError, mid-run).
"""

from __future__ import annotations

import json
import logging
import urllib.request

from forge_rl import store
from forge_rl.config import ConfigError

logger = logging.getLogger(__name__)


async def latest_pushed_version(prefix: str = "policy") -> int:
    """The newest version whose handle is in TorchStore (a push puts it last, once the bytes can be
    fetched); 0 (the model directory) when none is."""
    for version in reversed(await store.list_versions(prefix)):
        if await store.get_handle(version, prefix) is not None:
            return version
    return 0


async def catch_up(replica, prefix: str = "policy") -> None:
    """Service.after_restart for generators: load the newest pushed weights into a restarted replica.
    Looped because a push may land while it loads (the fanout of that version skipped this replica,
    which was not yet healthy)."""
    loaded = 0
    while (latest := await latest_pushed_version(prefix)) > loaded:
        await replica.actor.update_weights.call(latest)
        logger.warning("generator replica %d restarted and caught up to weights version %d", replica.index, latest)
        loaded = latest


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
