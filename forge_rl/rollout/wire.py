"""OpenEnv 0.10's wire protocol, spoken without importing openenv, whose MCP pins clash with vLLM's (the servers
run in a virtualenv of their own, docs/environments.md).

The protocol, as openenv/core/env_server/http_server.py serves it:
  WebSocket {url}/ws, one session (one environment instance) per connection. The client sends
    {"type": "reset", "data": {reset kwargs}}  {"type": "step", "data": {action fields}}  {"type": "close"}
  and the server answers each reset or step with
    {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
  or {"type": "error", "data": {"message", "code", ...}}. Over capacity the server accepts the connection,
  sends {"code": "CAPACITY_REACHED", "max_sessions": n, ...} and closes it.
  MCP (an MCPEnvironment's tools, RFC 003) on the same WebSocket, outside the episode:
    {"type": "mcp", "data": {"jsonrpc": "2.0", "id": n, "method": "tools/list" | "tools/call", "params": {...}}}
  answered {"type": "mcp", "data": {"jsonrpc": "2.0", "id": n, "result": ...} or {..., "error": {"code", "message"}}}.
  Tools are called in an episode as a step, {"type": "call_tool", "tool_name", "arguments"}: rollout/tools.py.
  HTTP: GET /health; the Task API GET /list_environments (the environment's name), GET /{name}/splits,
  POST /{name}/num_tasks {"split"}, POST /{name}/task {"split", "index"}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from forge_rl.core.rewards import checked_reward

MAX_MESSAGE_BYTES = 100 * 1024 * 1024  # OpenEnv's client default: an observation may carry a program's output


@dataclass
class StepResult:
    """The server's answer to a reset or a step. `observation`: the Observation's fields as a dict, with
    `reward` and `done` put back in, so it carries every field of the server's model (metadata aside)."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class ServerError(RuntimeError):
    """The server answered with an error message; `code` is OpenEnv's (VALIDATION_ERROR, CAPACITY_REACHED, ...),
    `data` the whole message (CAPACITY_REACHED carries max_sessions)."""

    def __init__(self, url: str, data: dict):
        self.code, self.data = data.get("code"), data
        detail = f"; {data['errors']}" if data.get("errors") else ""
        super().__init__(f"{url}: {data.get('message')} ({self.code}){detail}")


def ws_url(url: str) -> str:
    base = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(http):
            base = ws + base[len(http):]
    return base + "/ws"


def http_url(url: str) -> str:
    return url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")


class Connection:
    """One WebSocket session. Not safe for concurrent use: one request at a time."""

    def __init__(self, url: str, connect_timeout_s: float):
        self.url, self.connect_timeout_s = ws_url(url), connect_timeout_s
        self.ws: ClientConnection | None = None

    async def open(self) -> "Connection":
        loopback = any(h in self.url for h in ("://localhost", "://127.0.0.1", "://[::1]"))
        # No compression: messages are small, and deflate's CPU is the controller's, which drives every game.
        self.ws = await connect(self.url, open_timeout=self.connect_timeout_s, max_size=MAX_MESSAGE_BYTES,
                                compression=None, proxy=None if loopback else True)  # fmt: skip
        return self

    async def request(self, kind: str, data: dict[str, Any]) -> StepResult:
        """Send a reset or a step; the answer as a StepResult, or ServerError."""
        try:
            await self.ws.send(json.dumps({"type": kind, "data": data}))
        except WebSocketException:
            # Over capacity the server sends its error right after accepting, then closes: our send may
            # fail with the reason already buffered. Read it; else re-raise the drop.
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 1.0))
            if message.get("type") != "error":
                raise
        else:
            message = json.loads(await self.ws.recv())
        if message.get("type") == "error":
            raise ServerError(self.url, message.get("data", {}))
        if message.get("type") != "observation":  # another protocol's answer, read as one would be an empty observation
            runs = await asyncio.to_thread(openenv_version, http_url(self.url).removesuffix("/ws"))
            raise ServerError(self.url, {"code": "PROTOCOL", "message": f"answered a {kind} with a {message.get('type')!r} message, not "
                                         f"OpenEnv 0.10's observation; the server runs openenv {runs or '(its /health does not say)'}"})
        payload = message.get("data", {})
        # OpenEnv's server sends a NaN or inf reward as none, so a server must check its own (the dataset server does).
        reward = None if payload.get("reward") is None else checked_reward(payload["reward"], f"{self.url}'s reply")
        done = bool(payload.get("done", False))
        return StepResult({**payload.get("observation", {}), "reward": reward, "done": done}, reward, done)

    async def mcp(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One MCP JSON-RPC request (tools/list, tools/call); its `result`, or ServerError with its error."""
        await self.ws.send(json.dumps({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}}))
        message = json.loads(await self.ws.recv())
        answer = message.get("data", {})
        if message.get("type") != "mcp" or "error" in answer:
            raise ServerError(self.url, answer.get("error") or answer)
        return answer.get("result")

    async def close(self) -> None:
        """Ask the server to end the session, then close (closing first races the server's own close)."""
        ws, self.ws = self.ws, None
        if ws is None:
            return
        with contextlib.suppress(Exception):
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), 1.0)
        await ws.close()


def get_json(url: str, path: str, timeout_s: float, body: dict | None = None) -> Any:
    """GET (or POST `body` as JSON) `path` on the server at `url`; its JSON answer. urllib's errors propagate."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(http_url(url) + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def openenv_version(url: str) -> str | None:
    """The openenv version the server at `url` says it runs (forge_rl's servers put it in /health), or None."""
    try:
        return get_json(url, "/health", 5.0).get("openenv")
    except Exception:  # an error path already: what the server does not say stays unknown
        return None


def task_split_size(url: str, split: str, timeout_s: float) -> tuple[int | None, list[str]]:
    """(number of tasks in `split` or None when there is no such split, the splits the server has)."""
    try:
        (name, *_) = get_json(url, "/list_environments", timeout_s)
        splits = [s["name"] if isinstance(s, dict) else str(s) for s in get_json(url, f"/{name}/splits", timeout_s)]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{http_url(url)} serves no task splits ({e.code} {e.reason}): the environment has no list_splits()") from None
    if split not in splits:
        return None, splits
    return int(get_json(url, f"/{name}/num_tasks", timeout_s, {"split": split})["num_tasks"]), splits
