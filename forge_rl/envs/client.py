"""The client side of environments: one WebSocket session per episode, and local servers.

`EnvSession` wraps OpenEnv's `EnvClient` (the WebSocket protocol stays OpenEnv's) and adds what
a training run needs from a remote environment:
  - a timeout on every call (connect, reset, step), so a hung server cannot hang a rollout;
  - reconnect-and-retry when the connection drops or the server restarts mid-episode, restoring
    the episode on the new session (see `restore`); an episode that cannot be restored raises
    `EpisodeAborted` and is dropped by the caller, never continued on a wrong state;
  - typed errors: `EnvCapacityError` (server at MAX_CONCURRENT_ENVS), `EnvError` (the server
    refused a message; the session is still usable).

`launch_local` starts a server subprocess on 127.0.0.1 (a config's `env.server: module:Class`),
and `env_url` turns a config's env section into the URL to connect to.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import WebSocketException

RESTORE_MODES = ("replay", "reset", "none")


class EnvError(RuntimeError):
    """The server answered with an error (bad action, failed step); the session is still open."""


class EnvCapacityError(EnvError):
    """The server already serves MAX_CONCURRENT_ENVS sessions: raise it there, or add replicas."""


class EpisodeAborted(RuntimeError):
    """The episode's session was lost and could not be restored: drop the episode."""


# Failures after which the connection is in an unknown state: drop it, reconnect, restore.
_TRANSIENT = (ConnectionError, OSError, WebSocketException, asyncio.TimeoutError, EOFError)


class _WireClient(GenericEnvClient):
    """OpenEnv's dict client, raising typed errors instead of a bare RuntimeError.

    OpenEnv sends reward and done beside the observation; they are put back into the observation
    dict too, so it carries every field of the server's Observation model (metadata aside).
    """

    async def connect(self) -> _WireClient:
        """OpenEnv's connect without per-message compression (its messages are a few hundred bytes: deflating
        each cost the controller a tenth of its CPU time during rollouts, py-spy) and, on loopback, without
        a proxy from the environment, as OpenEnv bypasses it there."""
        if self._ws is None:
            loopback = any(h in self._ws_url.lower() for h in ("://localhost", "://127.0.0.1", "://[::1]"))
            try:
                self._ws = await ws_connect(
                    self._ws_url, open_timeout=self._connect_timeout, max_size=self._max_message_size,
                    compression=None, proxy=None if loopback else True,
                )
            except Exception as e:
                raise ConnectionError(f"Failed to connect to {self._ws_url}: {e}") from e
        return self

    async def disconnect(self) -> None:
        """Ask the server to end the session and let it close the socket. Closing first (as
        OpenEnv's client does) races the server's own close, which then logs a traceback."""
        if self._ws is not None:
            try:
                await self._send({"type": "close"})
                await asyncio.wait_for(self._ws.wait_closed(), 1.0)
            except Exception:
                pass
        await super().disconnect()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult:
        reward, done = payload.get("reward"), payload.get("done", False)
        observation = {**payload.get("observation", {}), "reward": reward, "done": done}
        return StepResult(observation=observation, reward=reward, done=done)

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            await self._send(message)
        except WebSocketException:
            # Over capacity, the server sends its error right after accepting, then closes: our
            # send fails, but the reason is already buffered. Read it; else re-raise the drop.
            response = await asyncio.wait_for(self._receive(), 1.0)
            if response.get("type") != "error":
                raise
        else:
            response = await self._receive()
        if response.get("type") == "error":
            data = response.get("data", {})
            kind = EnvCapacityError if data.get("code") == "CAPACITY_REACHED" else EnvError
            detail = f"; {data['errors']}" if data.get("errors") else ""
            raise kind(f"{self._ws_url}: {data.get('message')} ({data.get('code')}){detail}")
        return response


class EnvSession:
    """One episode at a time on one WebSocket session, restored if the connection is lost.

    restore: how to rebuild the episode on a new session after a drop.
      "replay": reset with the same arguments (and the seed the server reported in
                observation["seed"] if none was given), resend every acknowledged action, and
                check the last observation is identical; for deterministic environments (BlackJack).
      "reset":  reset with the same arguments, nothing else; for environments whose steps do
                not depend on earlier ones (the code interpreter).
      "none":   a drop after reset aborts the episode.
    Invariant: a call returns only observations of the episode as the caller has seen it; when
    that cannot be guaranteed it raises EpisodeAborted. Not safe for concurrent use; open one
    session per concurrent episode.
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
        self.reconnects = 0  # sessions rebuilt after a drop, over this object's life
        self._client: _WireClient | None = None
        self._reset_kwargs: dict[str, Any] | None = None  # None: no episode started
        self._actions: list[dict[str, Any]] = []
        self._last: StepResult | None = None
        self._lost = False  # the connection dropped mid-episode; restore before the next call

    async def reset(self, **kwargs: Any) -> StepResult:
        """Start a new episode (e.g. reset(seed=7)); observation is the server's dict."""
        self._reset_kwargs, self._actions, self._last, self._lost = None, [], None, False
        result = await self._call("reset", kwargs)
        seed = result.observation.get("seed")
        self._reset_kwargs = dict(kwargs) if "seed" in kwargs or seed is None else {**kwargs, "seed": seed}
        self._last = result
        return result

    async def step(self, action: Any) -> StepResult:
        """Send one action (a dict or an OpenEnv Action) and return the server's answer."""
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
            # Whatever the connection holds now is not the caller's episode: end it, so a
            # further step() fails loudly instead of acting on another state.
            await self._discard()
            self._reset_kwargs, self._actions, self._last, self._lost = None, [], None, False
            raise

    async def _call_with_retries(self, kind: str, payload: dict[str, Any]) -> StepResult:
        failures = 0
        while True:
            try:
                await self._connect()
                return await self._send(kind, payload)
            except EnvCapacityError:
                await self._discard()
                raise
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
        call = self._client.reset(**payload) if kind == "reset" else self._client.step(payload)
        return await asyncio.wait_for(call, self.timeout_s)

    async def _connect(self) -> None:
        """Open a connection if there is none, retrying with backoff; restore the episode if lost."""
        if self._client is not None:
            return
        deadline, delay = time.monotonic() + self.reconnect_window_s, 0.05
        while True:
            try:
                client = _WireClient(self.url, self.connect_timeout_s, self.timeout_s)
                self._client = await client.connect()
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
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.disconnect(), 2.0)
            except Exception:
                pass  # the connection is already broken; nothing to save


_RUNNING: "weakref.WeakSet[LocalServer]" = weakref.WeakSet()


@atexit.register
def _stop_local_servers() -> None:
    """A run that exits without stop() (an exception, Ctrl-C) must not leave servers behind."""
    for server in list(_RUNNING):
        server.stop()


class LocalServer:
    """An environment server subprocess on 127.0.0.1. Owns the process: stop() ends it, and so
    does the normal exit of this interpreter (not a SIGKILL of it)."""

    def __init__(self, target: str, port: int, env: dict[str, str] | None = None):
        self.target, self.port, self._env = target, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def start(self, timeout_s: float = 60.0) -> "LocalServer":
        """Start the process and wait for /health; raises with the server's log if it dies."""
        # module:Class goes through the generic launcher (which skips openenv's gradio import).
        module = ["forge_rl.envs", self.target] if ":" in self.target else [self.target]
        argv = [sys.executable, "-m", *module, "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, **(self._env or {})}
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        _RUNNING.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.target} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.target} not healthy on {self.url} after {timeout_s:g} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, timeout_s: float = 60.0) -> "LocalServer":
        """Stop and start again on the same port (sessions on the old process are lost)."""
        self.stop()
        return self.start(timeout_s)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-4000:]

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the environment servers', torch.distributed's, the tests')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(
    target: str,
    port: int | None = None,
    *,
    max_concurrent_envs: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> LocalServer:
    """Start `target` ('pkg.module:Class', or a module with a __main__) on 127.0.0.1; wait for /health."""
    extra = dict(env or {})
    if max_concurrent_envs is not None:
        extra["MAX_CONCURRENT_ENVS"] = str(max_concurrent_envs)
    return LocalServer(target, port or free_port(), extra).start(timeout_s)


def env_url(url: str | None = None, server: str | None = None, max_concurrent: int | None = None) -> tuple[str, LocalServer | None]:
    """A config's env section -> (URL to connect to, the server launched for it or None)."""
    if (url is None) == (server is None):
        raise ValueError("env: set exactly one of url (a running server) or server (module:Class)")
    if url is not None:
        return url, None
    # generous: on a loaded machine importing openenv alone takes tens of seconds
    local = launch_local(server, max_concurrent_envs=max_concurrent, timeout_s=180)
    return local.url, local
