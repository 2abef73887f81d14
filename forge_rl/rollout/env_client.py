"""The client side of environments: one WebSocket session per episode.

`EnvSession` speaks OpenEnv 0.10's protocol itself (wire.py; no openenv import) and adds what training needs:
a timeout on every call, so a hung server cannot hang a rollout; reconnect and restore when the connection
drops mid-episode; waiting while the server is full; typed errors. An episode that cannot be restored raises
`EpisodeAborted` and is dropped, never continued on a wrong state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from websockets.exceptions import WebSocketException

from forge_rl.core.rewards import REASONS, RewardError
from forge_rl.rollout.wire import Connection, ServerError, StepResult

RESTORE_MODES = ("replay", "reset", "none")


class EnvError(RuntimeError):
    """The server answered with an error (bad action, failed step); the session is still open."""

    reason = "env_error"  # what a group lost to it counts as (rollouts.py); so for the errors below


class EnvCapacityError(EnvError):
    """The server already serves MAX_CONCURRENT_ENVS sessions: raise it there, or add replicas."""

    max_sessions: int | None = None


class EpisodeAborted(RuntimeError):
    """The episode's session was lost and could not be restored: drop the episode."""

    reason = "session_lost"


class EnvTimeout(EpisodeAborted):
    """Not sent again: the server may still be working on it."""

    reason = "env_timeout"


# Failures after which the connection is in an unknown state: drop it, reconnect, restore.
_TRANSIENT = (ConnectionError, OSError, WebSocketException, asyncio.TimeoutError, EOFError)


def typed_error(error: ServerError) -> EnvError | RewardError:
    reason, _, detail = str(error.data.get("message")).partition(": ")
    if reason in REASONS:  # the dataset server's refusal of its reward function's answer (envs/dataset.py)
        return RewardError(reason, detail)
    if error.code == "CAPACITY_REACHED":
        typed = EnvCapacityError(str(error))
        typed.max_sessions = error.data.get("max_sessions")
        return typed
    return EnvError(str(error))


class EnvSession:
    """One episode at a time on one WebSocket session, restored if the connection is lost.

    restore: how to rebuild the episode on a new session after a drop.
      "replay": reset with the same arguments (and the seed the server reported), resend every acknowledged
                action, and check the last observation is identical; for deterministic environments.
      "reset":  reset with the same arguments only; for environments whose steps are independent.
      "none":   a drop after reset aborts the episode.
    Invariant: a call returns only observations of the episode as the caller has seen it, else raises
    EpisodeAborted. Not safe for concurrent use: one session per concurrent episode.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        reconnect_window_s: float = 30.0,
        max_restores: int = 3,
        restore: str = "replay",
        capacity_wait_s: float = 0.0,
    ):
        if restore not in RESTORE_MODES:
            raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be > 0")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_window_s = reconnect_window_s
        self.max_restores = max_restores
        self.restore = restore
        self.capacity_wait_s = capacity_wait_s
        self.reconnects = 0  # sessions rebuilt after a drop, over this object's life
        self.capacity_waits = 0  # times the server was full when this session asked for one
        self.on_full = None  # called with the max_sessions each CAPACITY_REACHED reports (SessionPool.fit)
        self._conn: Connection | None = None
        self._reset_kwargs: dict[str, Any] | None = None  # None: no episode started
        self._actions: list[dict[str, Any]] = []
        self._last: StepResult | None = None
        self._lost = False  # the connection dropped mid-episode; restore before the next call

    async def reset(self, **kwargs: Any) -> StepResult:
        """Start a new episode (e.g. reset(seed=7), reset(split="eval", index=3)); observation is the server's dict."""
        self._reset_kwargs, self._actions, self._last, self._lost = None, [], None, False
        result = await self._call("reset", kwargs)
        seed = result.observation.get("seed")
        self._reset_kwargs = dict(kwargs) if "seed" in kwargs or seed is None else {**kwargs, "seed": seed}
        self._last = result
        return result

    async def step(self, action: Any) -> StepResult:
        """Send one action (a dict, or a pydantic model) and return the server's answer."""
        if self._reset_kwargs is None:
            raise EnvError("step() before reset(): start an episode first")
        payload = action.model_dump() if hasattr(action, "model_dump") else dict(action)
        result = await self._call("step", payload)
        self._actions.append(payload)
        self._last = result
        return result

    async def close(self) -> None:
        await self._discard()

    async def __aenter__(self) -> "EnvSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, kind: str, payload: dict[str, Any]) -> StepResult:
        try:
            return await self._call_with_retries(kind, payload)
        except EpisodeAborted:
            # The connection no longer holds the caller's episode: a further step() must fail loudly.
            await self._discard()
            self._reset_kwargs, self._actions, self._last, self._lost = None, [], None, False
            raise

    async def _call_with_retries(self, kind: str, payload: dict[str, Any]) -> StepResult:
        failures, full_until, delay = 0, time.monotonic() + self.capacity_wait_s, 0.05
        while True:
            try:
                await self._connect()
                return await self._send(kind, payload)
            except EnvCapacityError as e:
                await self._discard()
                if self.on_full is not None:
                    self.on_full(e.max_sessions)
                if time.monotonic() + delay > full_until:
                    raise
                self.capacity_waits += 1
                await asyncio.sleep(delay)  # another client holds the server's sessions: wait for one to end
                delay = min(delay * 2, 1.0)
            except _TRANSIENT as e:
                await self._discard()
                failures += 1
                if self._reset_kwargs is None and kind == "reset" and failures <= self.max_restores:
                    continue  # nothing to restore yet: just try the reset again
                if self.restore == "none" or failures > self.max_restores:
                    raise EpisodeAborted(
                        f"{self.url}: connection lost ({type(e).__name__}: {e}) after "
                        f"{failures} attempt(s), restore={self.restore!r}; drop this episode"
                    ) from e
                self._lost = True

    async def _send(self, kind: str, payload: dict[str, Any]) -> StepResult:
        """One request on the current connection, bounded by timeout_s."""
        try:
            return await asyncio.wait_for(self._conn.request(kind, payload), self.timeout_s)
        except ServerError as e:
            raise typed_error(e) from None
        except asyncio.TimeoutError:
            # Unlike a drop, the server may still be working on it: resent, it would hold one more session each time.
            raise EnvTimeout(f"{self.url}: no answer to a {kind} within timeout_s={self.timeout_s:g} s; the episode ends") from None

    async def _connect(self) -> None:
        """Open a connection if there is none, retrying with backoff; restore the episode if lost."""
        if self._conn is not None:
            return
        deadline, delay = time.monotonic() + self.reconnect_window_s, 0.05
        while True:
            try:
                self._conn = await Connection(self.url, self.connect_timeout_s).open()
                if self._lost:
                    await self._restore()
                    self._lost = False
                    self.reconnects += 1
                return
            except EnvError as e:  # capacity while restoring, or the server refusing the replay
                await self._discard()
                if not isinstance(e, EnvCapacityError):
                    raise EpisodeAborted(f"{self.url}: could not restore the episode: {e}") from e
                cause = e
            except _TRANSIENT as e:
                await self._discard()
                cause = e
            if time.monotonic() + delay > deadline:
                where = "restore the episode" if self._lost else "connect"
                raise EpisodeAborted(
                    f"{self.url}: could not {where} within {self.reconnect_window_s:g} s "
                    f"({type(cause).__name__}: {cause}); is the server running?"
                ) from cause
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _restore(self) -> None:
        result = await self._send("reset", self._reset_kwargs)
        if self.restore == "replay":
            for action in self._actions:
                result = await self._send("step", action)
            if self._last is not None and result != self._last:
                raise EpisodeAborted(
                    f"{self.url}: replaying seed and {len(self._actions)} action(s) on a new "
                    "session gave a different observation; the environment is not deterministic "
                    "(use restore='reset' or 'none' for it)"
                )

    async def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # the connection is already broken; nothing to save
                await asyncio.wait_for(conn.close(), 2.0)
