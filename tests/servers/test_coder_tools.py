"""The code tools environment (apps/coder/tools_env.py) in-process, in the servers' virtualenv, through
OpenEnv's own MCP types: tools listed, run_python runs in the sandbox, submit grades and ends the episode."""

import asyncio

import pytest
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

from apps.coder.task_sets import split_tasks
from apps.coder.tools_env import CodeToolsEnvironment


def text(observation) -> str:
    return observation.result.content[0].text


def test_tools_run_and_submit_grades_the_hidden_tests():
    env = CodeToolsEnvironment()
    assert [t.name for t in env.step(ListToolsAction()).tools] == ["run_python", "submit"]  # before any reset
    task = split_tasks()["eval"][0]
    first = env.reset(split="eval", index=0, max_turns=3)
    assert first.task_id == task.task_id and not any(test in first.model_dump_json() for test in task.tests)

    async def episode(program: str):
        run = await env.step_async(CallToolAction(tool_name="run_python", arguments={"code": "print(6*7)"}))
        end = await env.step_async(CallToolAction(tool_name="submit", arguments={"code": program}))
        after = await env.step_async(CallToolAction(tool_name="run_python", arguments={"code": "print(1)"}))
        return run, end, after

    run, end, after = asyncio.run(episode("def nothing(): pass"))
    assert text(run).startswith("exit code 0\nstdout:\n42") and not run.done and run.reward is None
    assert end.done and end.reward == 0.0 and text(end).startswith("no_function: 0 of")
    assert after.done and after.reward == 0.0 and "episode is over" in after.result


def test_an_episode_without_a_submission_ends_at_max_turns_with_no_reward():
    env = CodeToolsEnvironment()
    env.reset(seed=1, max_turns=2)
    call = CallToolAction(tool_name="run_python", arguments={"code": "print(1)"})
    first, second = env.step(call), env.step(call)
    assert not first.done and second.done and second.reward == 0.0


def answer_from(tests) -> str:
    """A program that passes `tests` ("assert name(args) == value" lines) by answering each call from them."""
    entry = tests[0].split("(", 1)[0][len("assert "):]
    table = {}
    for test in tests:
        call, value = test[len("assert "):].rsplit(" == ", 1)
        table[repr(eval("(lambda *a: a)" + call[len(entry):]))] = eval(value)
    return f"def {entry}(*args):\n    return {table!r}[repr(args)]\n"


@pytest.mark.parametrize("path", ["step", "step_async"])
def test_a_submit_after_max_turns_is_refused_on_every_step_path(path):
    """An episode that ran out of turns ended with reward 0: a submit sent after it is refused, reward 0, on the
    synchronous and the asynchronous step alike (it was graded 1.0 by step_async, and step() had no guard at all),
    while the same answer within the limit scores 1."""
    right = answer_from(split_tasks()["eval"][0].tests)
    env = CodeToolsEnvironment()

    def step(tool: str, code: str):
        action = CallToolAction(tool_name=tool, arguments={"code": code})
        return env.step(action) if path == "step" else asyncio.run(env.step_async(action))

    env.reset(split="eval", index=0, max_turns=1)
    last, late = step("run_python", "print(1)"), step("submit", right)
    assert last.done and last.reward == 0.0
    assert late.done and late.reward == 0.0 and "episode is over" in late.result, late
    env.reset(split="eval", index=0, max_turns=1)
    assert step("submit", right).reward == 1.0


def test_the_tool_server_refuses_the_task_sets_with_hidden_data_in_rlimits_mode(monkeypatch):
    """The tool server picks its task as the code server does (env.served_task): in rlimits mode, whose programs see
    this host's files, the functions and humaneval sets (their tests and solutions are files here) are refused at
    reset, saying why, so no run_python call can read them (in rlimits mode as root a run_python call read both)."""
    from apps.coder import tools_env
    from apps.coder.sandbox import Limits, Sandbox

    monkeypatch.setattr(tools_env, "shared_sandbox", lambda: Sandbox(Limits(timeout_s=10), isolation="rlimits"))
    env = tools_env.CodeToolsEnvironment()
    for split, task_set in (("humaneval_eval", "humaneval"), ("eval", "functions")):
        with pytest.raises(ValueError, match=f"task_set '{task_set}' is refused: programs in this server's rlimits sandbox"):
            env.reset(split=split, index=0)
