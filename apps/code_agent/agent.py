"""A tool-using code agent: small Python tasks solved with a `run_python` tool backed by the code interpreter.

The chat-agent form with tools. The agent talks to the policy through an unmodified AsyncOpenAI
client and offers it one tool, run_python; each call runs in the code interpreter environment
(apps/coder/interpreter.py, sandboxed) and what it printed goes back as the tool's result. The
first reply without a tool call is the answer: its ```python block is graded by the task's tests in
the same environment, out of the program's process (the interpreter calls its function and compares
the values it returns), and that reward (the fraction of tests passed) stands.

A config runs it as any agent app: `app_module: apps.code_agent.agent`, `sampling.constrained: false`,
`env.server: apps.coder.interpreter:CodeInterpreterEnvironment`, `chat.tool_parser` the model's tool-call
format (configs/blackjack_agent_tiny_cpu.yaml is the agent form's example).
"""

from __future__ import annotations

import json
import re

from openai import AsyncOpenAI

TASKS = [  # (task, function, tests: (arguments, value)); the seed picks one, so the agents of a group solve the same task
    ("Write a Python function add(a, b) that returns the sum of a and b.", "add", [([2, 3], 5), ([-1, 1], 0)]),
    ("Write a Python function is_even(n) that returns True when n is even.", "is_even", [([4], True), ([7], False)]),
    ("Write a Python function reverse(s) that returns the string s reversed.", "reverse", [(["abc"], "cba"), ([""], "")]),
    ("Write a Python function square(x) that returns x times x.", "square", [([3], 9), ([-2], 4)]),
]
SYSTEM = "You solve Python tasks. Call run_python to try code. Finish with the whole program in a ```python block."
RUN_PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python program and return what it prints (stdout and stderr)",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
MAX_TOOL_ROUNDS = 4  # replies with tool calls before the agent stops asking
MAX_OUTPUT_CHARS = 2000  # of a tool result sent back to the policy


def program(answer: str) -> str:
    """The last ```python block of the answer, or the whole answer."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", answer, re.DOTALL)
    return blocks[-1] if blocks else answer


async def run_python(env, arguments: str) -> str:
    try:
        code = json.loads(arguments)["code"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"error: run_python takes {{\"code\": \"...\"}}: {e}"
    observation = (await env.step({"code": str(code)})).observation
    return (observation["stdout"] + observation["stderr"])[-MAX_OUTPUT_CHARS:]


def submission(code: str, seed: int) -> dict:
    """The interpreter action that grades `code` on the tests of the seed's task (out of its process)."""
    _, function, tests = TASKS[seed % len(TASKS)]
    return {"code": code, "entry_point": function, "tests": [{"args": a, "expected": v} for a, v in tests]}


async def run_agent(ctx) -> float | None:
    task, _, _ = TASKS[ctx.seed % len(TASKS)]
    await ctx.env.reset(seed=ctx.seed)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, timeout=300) as client:
        for _ in range(MAX_TOOL_ROUNDS + 1):
            response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[RUN_PYTHON])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                output = await run_python(ctx.env, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    await ctx.env.step(submission(program(message.content or ""), ctx.seed))
    return None  # the interpreter's reward: the fraction of the tests passed
