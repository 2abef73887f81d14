"""The code tools environment (tools_env.py) played by an agent written against the OpenAI API: the tools the
server lists come as `ctx.tools` (the SDK's `tools=`), each tool call the policy makes (parsed by the chat
server's `chat.tool_parser`) is sent with `ctx.env.call_tool`, its result goes back as a `tool` message, and
the environment's reward stands once submit ends the episode. The same task and prompt as tools_task.py, its
environment form: a config switches between the two with `app_module` alone.
"""

from __future__ import annotations

from openai import AsyncOpenAI, BadRequestError

from apps.coder.tools_task import SYSTEM_PROMPT, eval_metrics, render_prompt

MCP_TOOLS = True
__all__ = ["MCP_TOOLS", "run_agent", "eval_metrics"]


async def run_agent(ctx) -> float | None:
    observation = (await ctx.env.reset(seed=ctx.seed)).observation  # with env.task_split: the group's task
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": render_prompt(observation)}]
    # The run's connection pool (ctx.http_client) is shared, so the client is not closed here.
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client, timeout=600)
    while not ctx.env.done:
        try:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)
        except BadRequestError as e:
            if e.code == "context_length_exceeded":  # the conversation outgrew generator.max_model_len
                return ctx.cutoff_reward  # as the environment form scores it
            raise
        message = reply.choices[0].message
        if not message.tool_calls:
            return ctx.invalid_reward  # an answer that calls no tool is invalid, as in the environment form
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = await ctx.env.call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if ctx.env.done:
                break
    return None  # the environment's reward: submit's grade, or 0 after its max_turns calls
