"""The reverse chat server: the OpenAI and Anthropic chat APIs, answered by the policy, recording exact ids.

    agent (any SDK) --POST /s/<rollout_id>/v1/chat/completions or /v1/messages--> ChatServer
        --prompt ids (segments.py)--> policy service (vLLM Generators) --Completion--+
    agent <--reply: text, tool calls (vLLM's tool parser)-- ChatServer <---------------------+
    GET /s/<rollout_id>/trajectory --> the rollout's segments: exact ids, sampled mask, log-probs, versions

Each rollout has its own base URL, `/s/<rollout_id>/v1`, so an unmodified SDK client is one rollout (Anthropic's
SDK appends /v1 itself: give it `/s/<rollout_id>`). Run alone: forge_rl/chat_server.py.

Sampling comes from the run config, never the caller: a caller's temperature would change the distribution the
trainer takes for the behaviour policy. A retried identical request gets the recorded reply, not a second sample.
Bad input gets the protocol's error and leaves the record as it was. One rollout's requests are answered in order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from forge_rl.core.config import ChatConfig
from forge_rl.core.rewards import RewardError, checked_reward
from forge_rl.core.types import Completion, Episode
from forge_rl.rollout.segments import Renderer, Segment, commit, normalize_message, plan_request

logger = logging.getLogger("forge_rl.chat_server")
IGNORED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "stop")


class ChatError(Exception):
    """A request the server refuses: HTTP status, OpenAI-style error code, one-line message."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Reply:
    content: str
    tool_calls: list[dict]  # OpenAI form: {"id", "type": "function", "function": {"name", "arguments": JSON text}}
    finish_reason: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Rollout:
    """One agent run's record. `previous`: (prompt ids, answer ids) of the last completion, by which a group's
    games share requests."""

    rollout_id: str
    answer: Callable[[list[int], tuple | None], Awaitable[Completion]]
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None
    ended: bool = False
    replies: dict[str, Reply] = field(default_factory=dict)  # request (messages, tools) -> recorded reply
    previous: tuple | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def to_json(self) -> dict:
        segments = [s.to_json() for s in self.segments]
        return {"rollout_id": self.rollout_id, "reward": self.reward, "ended": self.ended, "segments": segments}

    def episodes(self, group_id: str) -> list[Episode]:
        """One Episode per segment the policy sampled in, all with this rollout's id and reward."""
        reward = 0.0 if self.reward is None else self.reward
        return [s.to_episode(reward, group_id, self.rollout_id) for s in self.segments if any(s.sampled)]


class ChatServer:
    """Serves the chat APIs on the running event loop; `generate(prompt_ids, sampling, session)` is sticky per session."""

    def __init__(self, tokenizer, generate, sampling: dict, greedy: dict, config: ChatConfig, max_model_len: int,
                 template_kwargs: dict | None = None):
        self.tokenizer, self.renderer = tokenizer, Renderer(tokenizer, template_kwargs)
        self.generate = generate
        # A reply ends at the template's end of turn, also where that is not the tokenizer's eos (a base model's).
        stop = {"stop_token_ids": [self.renderer.end_id]} if self.renderer.end_id != tokenizer.eos_token_id else {}
        self.sampling, self.greedy = {**sampling, **stop}, {**greedy, **stop}
        self.config, self.max_model_len = config, max_model_len
        self.rollouts: dict[str, Rollout] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()  # recently ended ids, to say "ended", not "unknown"
        self.tool_parser = None
        self.url, self._runner = "", None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> str:
        if self.config.tool_parser:
            from vllm.tool_parsers import ToolParserManager

            try:
                self.tool_parser = ToolParserManager.get_tool_parser(self.config.tool_parser)
            except KeyError:
                known = ", ".join(ToolParserManager.list_registered())
                raise SystemExit(f"config error: chat.tool_parser {self.config.tool_parser!r} is not a vLLM tool parser ({known})")
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([
            web.get("/health", lambda _: web.json_response({"status": "ok", "model": self.config.model_name})),
            web.post("/rollouts", self._open),
            web.post("/s/{rollout_id}/end", self._end),
            web.get("/s/{rollout_id}/trajectory", self._trajectory),
            web.get("/s/{rollout_id}/v1/models", self._models),
            web.post("/s/{rollout_id}/v1/chat/completions", self._chat_completions),
            web.post("/s/{rollout_id}/v1/messages", self._messages),
        ])
        # Stopping waits this long for requests in flight, then cancels them (aiohttp's default waits 60 s).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        sock = socket.create_server((self.config.host, self.config.port))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self.config.host}:{sock.getsockname()[1]}"
        shown = {k: v for k, v in self.sampling.items() if k != "allowed_token_ids"}
        logger.warning(
            "chat server on %s: sampling comes from the run config %s; callers' %s are ignored, so the trainer "
            "scores the distribution that sampled", self.url, shown, ", ".join(IGNORED_SAMPLING),
        )
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_rollout(self, answer=None, greedy: bool = False, rollout_id: str | None = None) -> Rollout:
        """`answer` defaults to the policy with the run's sampling (greedy: the evaluation's)."""
        rollout_id = rollout_id or uuid.uuid4().hex
        if answer is None:
            params = self.greedy if greedy else self.sampling

            async def answer(prompt_ids, previous):
                return (await self.generate(prompt_ids, params, rollout_id))[0]

        rollout = self.rollouts[rollout_id] = Rollout(rollout_id, answer)
        return rollout

    async def end_rollout(self, rollout_id: str, reward: float | None) -> Rollout:
        """The rollout takes no more requests (waits for the one in progress); its record is returned."""
        rollout = self.rollouts.pop(rollout_id)
        async with rollout.lock:
            rollout.ended, rollout.reward = True, reward
        self.finished[rollout_id] = None
        while len(self.finished) > 100_000:
            self.finished.popitem(last=False)
        return rollout

    # ---- one request, whatever the protocol ------------------------------------------------------

    async def complete(self, rollout: Rollout, messages: list[dict], tools: list[dict] | None, request) -> Reply:
        """The reply to a request (OpenAI-form messages), sampled and recorded, or the recorded one of a retry."""
        messages = [normalize_message(m) for m in messages]
        key = json.dumps([messages, tools], sort_keys=True)
        async with rollout.lock:
            if rollout.ended:
                raise ChatError(400, f"rollout {rollout.rollout_id} has ended; it takes no more requests", "rollout_ended")
            if key in rollout.replies:
                return rollout.replies[key]
            open_segment = rollout.segments[-1] if rollout.segments else None
            try:
                plan = plan_request(self.renderer, open_segment, messages, tools)
            except Exception as e:  # the chat template refused these messages
                raise ChatError(400, f"the model's chat template cannot render these messages: {e}") from None
            prompt = plan.token_ids if plan.new_segment else open_segment.token_ids + plan.token_ids
            if len(prompt) >= self.max_model_len:
                raise ChatError(
                    400, f"the prompt is {len(prompt)} tokens; this model serves at most {self.max_model_len} "
                    "(generator.max_model_len) including the reply", "context_length_exceeded",
                )
            completion = await rollout.answer(prompt, rollout.previous)
            content, calls = self._tool_calls(completion.text, tools, request)
            finish = "tool_calls" if calls else ("length" if completion.finish_reason == "length" else "stop")
            reply = Reply(content, calls, finish, len(prompt), len(completion.token_ids))
            said = normalize_message({"role": "assistant", "content": content, "tool_calls": calls})
            commit(rollout.segments, plan, completion, messages, said)
            rollout.previous = (tuple(completion.prompt_ids), tuple(completion.token_ids))
            rollout.replies[key] = reply
            return reply

    def _tool_calls(self, text: str, tools, request) -> tuple[str, list[dict]]:
        """(content, tool calls) of a reply, by vLLM's tool parser for the model's format."""
        if self.tool_parser is None or not tools or getattr(request, "tool_choice", None) == "none":
            return text, []
        info = self.tool_parser(self.tokenizer, request.tools).extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in info.tool_calls
        ]
        return info.content or "", calls

    # ---- HTTP ------------------------------------------------------------------------------------

    def _rollout(self, request: web.Request) -> Rollout:
        rollout_id = request.match_info["rollout_id"]
        if rollout_id in self.rollouts:
            return self.rollouts[rollout_id]
        if rollout_id in self.finished:
            raise ChatError(400, f"rollout {rollout_id} has ended; it takes no more requests", "rollout_ended")
        raise ChatError(404, f"unknown rollout {rollout_id!r}: open one first (POST /rollouts)", "rollout_not_found")

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ChatError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ChatError(400, "the request body must be a JSON object")
        return body

    async def _reply(self, request: web.Request, parse: Callable[[dict], object]) -> tuple:
        """(vLLM's chat request, the reply) for a request of either protocol; `parse` makes the first of the body."""
        from pydantic import ValidationError

        rollout = self._rollout(request)
        body = await self._body(request)
        try:
            req = parse(body)
        except ValidationError as e:
            raise ChatError(400, f"invalid request: {_first_error(e)}") from None
        if req.model != self.config.model_name:
            raise ChatError(404, f"model {req.model!r} is not served here; use {self.config.model_name!r}", "model_not_found")
        if (req.n or 1) != 1:
            raise ChatError(400, f"n={req.n}: this server samples one reply per request")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return req, await self.complete(rollout, list(req.messages), tools, req)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            req, reply = await self._reply(request, ChatCompletionRequest.model_validate)
        except ChatError as e:
            error = {"message": e.message, "type": _error_type(e.status), "param": None, "code": e.code}
            return web.json_response({"error": error}, status=e.status)
        response = openai_response(reply, self.config.model_name)
        if not req.stream:
            return web.json_response(response)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _send_events(request, openai_chunks(response, usage))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        def parse(body: dict):  # vLLM's conversion; the chat request keeps the model name and `stream`
            return AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body))

        try:
            req, reply = await self._reply(request, parse)
        except ChatError as e:
            error = {"type": "error", "error": {"type": _error_type(e.status), "message": e.message}}
            return web.json_response(error, status=e.status)
        message = anthropic_message(reply, self.config.model_name)
        return await _send_events(request, anthropic_events(message)) if req.stream else web.json_response(message)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "forge_rl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _open(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request) if request.can_read_body else {}
        except ChatError as e:
            return web.json_response({"error": {"message": e.message}}, status=e.status)
        rollout = self.open_rollout(greedy=bool(body.get("greedy")))
        return web.json_response({"rollout_id": rollout.rollout_id, "base_url": f"{self.url}/s/{rollout.rollout_id}/v1"})

    async def _end(self, request: web.Request) -> web.Response:
        try:
            self._rollout(request)
            body = await self._body(request) if request.can_read_body else {}
            reward = None if body.get("reward") is None else checked_reward(body["reward"], "the request")  # json.loads reads NaN
        except RewardError as e:
            return web.json_response({"error": {"message": f"reward must be a finite number or null: {e}", "code": e.reason}}, status=400)
        except ChatError as e:
            return web.json_response({"error": {"message": e.message, "code": e.code}}, status=e.status)
        rollout = await self.end_rollout(request.match_info["rollout_id"], reward)
        return web.json_response(rollout.to_json())

    async def _trajectory(self, request: web.Request) -> web.Response:
        rollout = self.rollouts.get(request.match_info["rollout_id"])
        if rollout is None:
            return web.json_response({"error": {"message": "unknown or ended rollout", "code": "rollout_not_found"}}, status=404)
        return web.json_response(rollout.to_json())


# ---- the two protocols' replies ------------------------------------------------------------------


def openai_response(reply: Reply, model: str) -> dict:
    message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                  "total_tokens": reply.prompt_tokens + reply.completion_tokens},
    }


def openai_chunks(response: dict, include_usage: bool) -> list[str]:
    """A whole reply as an OpenAI stream (the policy answers whole; streaming is the wire format only)."""
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = response["choices"][0]

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if choice["message"]["content"]:
        chunks.append(chunk({"content": choice["message"]["content"]}))
    for i, call in enumerate(choice["message"].get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append(head | {"choices": [], "usage": response["usage"]})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def anthropic_message(reply: Reply, model: str) -> dict:
    blocks = [{"type": "text", "text": reply.content}] if reply.content or not reply.tool_calls else []
    for call in reply.tool_calls:
        arguments = json.loads(call["function"]["arguments"] or "{}")
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(reply.finish_reason, "end_turn")
    return {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": blocks,
        "stop_reason": stop, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
    }


def anthropic_events(message: dict) -> list[str]:
    start = message | {"content": [], "stop_reason": None, "usage": message["usage"] | {"output_tokens": 0}}
    events = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {k: block[k] for k in ("type", "id", "name")} | {"input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    done = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events += [
        ("message_delta", {"type": "message_delta", "delta": done, "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return [f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events]


async def _send_events(request: web.Request, events: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(event.encode())
    await response.write_eof()
    return response


def _error_type(status: int) -> str:
    return {404: "not_found_error"}.get(status, "invalid_request_error")


def _first_error(e) -> str:
    first = e.errors()[0]
    return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
