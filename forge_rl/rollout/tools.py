"""MCP tool environments as the policy's tools: an OpenEnv `MCPEnvironment` trains unmodified.

An app with `MCP_TOOLS = True` (core/app.py) acts by tool calls. At the start of a run the server's tools
(MCP tools/list) become the function specs chat templates and the OpenAI API take. Each game (play.py):

    the first turn     render_prompt(reset observation) with the tools passed to the chat template; a template
                       without a tool format gets them in the system message (`tools_in_system`)
    the answer         its first Hermes <tool_call>, read by vLLM's Hermes parser (as `chat.tool_parser: hermes`),
                       becomes OpenEnv's CallToolAction; an answer without one is invalid
    the next turn      the tool's result, or the server's error, as a `tool` message
    the reward         the environment's, once it says done

An agent app (agents.py) gets the same tools as `ctx.tools` and `ctx.env.call_tool(name, arguments)`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from forge_rl.rollout.wire import Connection

HERMES_TOOLS = (
    "You may call one of these tools:\n<tools>\n{tools}\n</tools>\n"
    'Call one by answering <tool_call>{{"name": <tool name>, "arguments": <its arguments as a JSON object>}}</tool_call>'
)


CALL_OPENING = "<tool_call>\n"  # how a Hermes call opens: sampling.tool_choice "required" writes it (play.py)


async def list_tools(url: str, timeout_s: float) -> list[dict[str, Any]]:
    """The server's tools as MCP lists them: [{"name", "description", "inputSchema"}, ...]."""
    connection = await Connection(url, timeout_s).open()
    try:
        return list((await asyncio.wait_for(connection.mcp("tools/list"), timeout_s))["tools"])
    finally:
        await connection.close()


def tools_in_system(system: str | None, tools) -> str:
    """For a chat template without a tool format; both forms of an app render tools with this one definition."""
    listed = "\n".join(json.dumps(spec) for spec in tools)
    return "\n\n".join(filter(None, [system, HERMES_TOOLS.format(tools=listed)]))


def function_specs(tools: list[Mapping[str, Any]]) -> tuple[dict, ...]:
    """MCP tools (or OpenEnv's Tool model, `input_schema`) as the function specs chat templates render."""
    return tuple(
        {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                          "parameters": t.get("inputSchema") or t.get("input_schema") or {"type": "object"}}}
        for t in tools
    )  # fmt: skip


async def with_tools(app, url: str, timeout_s: float):
    """The app with the server's tools and, unless it has its own, the tool-call parser as parse_action (an
    agent app parses nothing: the chat server does)."""
    if not app.uses_tools:
        return app
    specs = function_specs(await list_tools(url, timeout_s))
    if not specs:
        raise RuntimeError(f"{url}: the environment lists no tools (MCP tools/list), and {app.name} acts only by tools")
    parse = app.parse_action or (None if app.is_agent else parse_tool_call)
    return dataclasses.replace(app, tools=specs, parse_action=parse)


def call_tool_action(name: str, arguments: Mapping | str | None) -> dict:
    """OpenEnv's CallToolAction for a call an agent's SDK reports (arguments as a JSON object or its text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise ValueError(f"the arguments of {name!r} are not JSON: {arguments[:200]!r}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"the arguments of {name!r} must be a JSON object, got {arguments!r}"[:300])
    return {"type": "call_tool", "tool_name": name, "arguments": dict(arguments)}


def parse_tool_call(text: str, observation: Any = None) -> dict | None:
    """The answer's first tool call as a call_tool action, or None when it has none a server could call.
    A call of an unknown tool is sent as it is: the environment's tool_not_found is what the policy learns from."""
    calls = _hermes().extract_tool_calls(text, None).tool_calls  # any error of its reading is "no call"
    try:
        return call_tool_action(calls[0].function.name, calls[0].function.arguments) if calls else None
    except ValueError:
        return None


@functools.cache
def _hermes():
    """A placeholder tokenizer: only streaming needs one. vLLM's traceback of each malformed call is silenced:
    it is the policy's answer, not a fault."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser, logger

    logger.setLevel(logging.CRITICAL)
    return Hermes2ProToolParser(tokenizer=object())


def is_tool_result(observation: Mapping) -> bool:
    """Whether the observation answers a tool call (OpenEnv's CallToolObservation), not a reset's."""
    return "tool_name" in observation


def tool_result_text(observation: Mapping) -> str:

    error, result = observation.get("error"), observation.get("result")
    if error:
        return f"error ({error.get('error_type')}): {error.get('message')}" if isinstance(error, Mapping) else f"error: {error}"
    if isinstance(result, Mapping) and isinstance(result.get("content"), list):
        return "\n".join(c.get("text", "") for c in result["content"] if isinstance(c, Mapping) and c.get("type") == "text")
    return result if isinstance(result, str) else json.dumps(result)
