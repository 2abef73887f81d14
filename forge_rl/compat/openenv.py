"""openenv-core 0.3 internals: the WebSocket client's connection and messages, the server's /health route,
and the web UI import.

- `WireClient`: OpenEnv's dict client (`GenericEnvClient`) reached through its private `_ws`, `_ws_url`,
  `_connect_timeout`, `_max_message_size`, `_send` and `_receive`, to connect without per-message
  compression (messages are a few hundred bytes: deflate saves little on the wire and its CPU is the
  controller's, which drives every game) and without a proxy on loopback; to end a session by asking the server to close it (closing
  first races the server's own close, which logs a traceback); and to turn the server's error messages
  into exceptions of the caller's choosing (`server_error`).
- `replace_route`: OpenEnv's /health says only "healthy"; servers replace that route in the FastAPI app's
  route list.
- `skip_gradio`: openenv imports gradio (seconds) for a web UI no server here mounts; a server process
  marks it absent before importing openenv, which catches the ImportError.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from forge_rl.compat import require


def skip_gradio() -> None:
    sys.modules.setdefault("gradio", None)


def replace_route(app, path: str, handler, methods: list[str]) -> None:
    """Serve `path` with `handler` instead of the route the app already has there."""
    require("openenv", "0.3.0", __name__)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.add_api_route(path, handler, methods=methods)


def wire_client_class():
    """The WireClient class (built on first use: importing openenv's client costs a second)."""
    global _WireClient
    if _WireClient is None:
        _WireClient = _build_wire_client()
    return _WireClient


_WireClient = None


def _build_wire_client():
    require("openenv", "0.3.0", __name__)
    from openenv.core.client_types import StepResult
    from openenv.core.generic_client import GenericEnvClient
    from websockets.asyncio.client import connect as ws_connect
    from websockets.exceptions import WebSocketException

    class WireClient(GenericEnvClient):
        """OpenEnv's dict client; reward and done are put back into the observation dict too, so it
        carries every field of the server's Observation model (metadata aside)."""

        def server_error(self, url: str, data: dict) -> Exception:
            """The exception for an error message of the server at `url` (`data`: its code, message, errors)."""
            return RuntimeError(f"{url}: {data.get('message')} ({data.get('code')})")

        async def connect(self):
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
                raise self.server_error(self._ws_url, response.get("data", {}))
            return response

    return WireClient
