"""The code interpreter offered as MCP tools: an `MCPEnvironment` whose agent acts only by calling tools.

reset(seed) (or reset(split=..., index=...): OpenEnv's Task API, the code server's `functions` and
`humaneval` splits, task_sets.py) shows a task's statement and the function to write; its tests stay here.
The tools (tools/list, JSON-schema arguments; no reset needed to list them):

    run_python(code)   runs the program in the sandbox: its exit code, stdout and stderr. The episode goes on.
    submit(code)       grades the program on the task's hidden tests (env.py's grading, remembered per
                       program); the episode ends and its reward is the fraction of tests passed.

An action is OpenEnv's CallToolAction, `{"type": "call_tool", "tool_name": ..., "arguments": {...}}`, sent
as a step; the observation is OpenEnv's CallToolObservation (the tool's text result in `result`, a call the
server could not make in `error`), with `done` and `reward` set by submit. The same tools also answer MCP's
own JSON-RPC (`{"type": "mcp", "data": {"method": "tools/call", ...}}`, or POST /mcp), outside any episode's
reward. After `max_turns` tool calls without a submission the episode ends with reward 0.

    python -m forge_rl.envs apps.coder.tools_env:CodeToolsEnvironment --port 8000
Sandbox limits: SANDBOX_TIMEOUT_S, SANDBOX_MEMORY_MB, SANDBOX_ISOLATION, as for env.py (whose sandbox it shares).
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Optional

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from apps.coder.env import MAX_CODE_CHARS, graded, served_task, shared_sandbox, verdict
from apps.coder.task_sets import TaskSplits

MAX_OUTPUT_CHARS = 2_000  # of each stream a tool result shows (the end of it)


class ToolTaskObservation(Observation):
    """What reset shows: the task, never its tests."""

    task_id: str = ""
    statement: str = ""
    entry_point: str = ""
    max_turns: int = 0
    seed: Optional[int] = None


class CodeToolsEnvironment(TaskSplits, MCPEnvironment, Environment[CallToolAction, CallToolObservation, State]):
    """One task per episode; sessions share only the sandbox (and the grades it remembers)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("code-tools")
        sandbox = shared_sandbox()

        @mcp.tool
        def run_python(code: str) -> str:
            """Run a Python program in a sandbox and return its exit code, stdout and stderr."""
            if len(code) > MAX_CODE_CHARS:
                return f"error: the program is longer than {MAX_CODE_CHARS} characters"
            run = sandbox.run(code)
            status = "timed out" if run.timed_out else f"exit code {run.exit_code}"
            return f"{status}\nstdout:\n{run.stdout[-MAX_OUTPUT_CHARS:]}\nstderr:\n{run.stderr[-MAX_OUTPUT_CHARS:]}"

        @mcp.tool
        def submit(code: str) -> str:
            """Submit the final program defining the function: it is graded on hidden tests and the task ends."""
            if self._task is None:
                return "error: no task (reset first)"
            passed, total = graded(sandbox, self._task, code[:MAX_CODE_CHARS])
            self._graded = (passed, total)
            return f"{verdict(code, self._task.entry_point, (passed, total))}: {passed} of {total} hidden tests passed"

        super().__init__(mcp)
        self._task = None
        self._graded: tuple[int, int] | None = None
        self._max_turns = 8
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, split: Optional[str] = None,
              index: Optional[int] = None, max_turns: int = 8, **kwargs: Any) -> ToolTaskObservation:
        seed = secrets.randbits(31) if seed is None else seed
        self._task = served_task(shared_sandbox(), "functions", seed, split=split, index=index)
        self._graded, self._max_turns = None, max(1, max_turns)
        self._state = State(episode_id=episode_id)
        return ToolTaskObservation(task_id=self._task.task_id, statement=self._task.statement,
                                   entry_point=self._task.entry_point, max_turns=self._max_turns, seed=seed)  # fmt: skip

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._over(action) or self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._over(action) or self._scored(super().step(action, timeout_s=timeout_s, **kwargs))

    def _over(self, action: Action) -> Observation | None:
        """The answer to a tool call once the episode has ended (no task, a submission, or `max_turns` calls),
        checked on both step paths: a submit graded after the last turn would earn a reward the episode never had."""
        ended = self._task is None or self._graded is not None or self._state.step_count >= self._max_turns
        if not (isinstance(action, CallToolAction) and ended):
            return None
        return CallToolObservation(tool_name=action.tool_name, done=True, reward=0.0,
                                   result="error: the episode is over: reset for a new task")  # fmt: skip

    def _scored(self, observation: Observation) -> Observation:
        """The episode's end and reward on a tool call's observation: submit's grade, or 0 out of turns."""
        if isinstance(observation, CallToolObservation):
            self._state.step_count += 1
            if self._graded is not None:
                passed, total = self._graded
                observation.done, observation.reward = True, passed / max(total, 1)
            elif self._state.step_count >= self._max_turns:
                observation.done, observation.reward = True, 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        raise ValueError(f"this environment is acted on by tool calls (call_tool), not {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state

    @classmethod
    def health_info(cls) -> dict[str, Any]:
        sandbox = shared_sandbox()
        return {"isolation": sandbox.isolation, "timeout_s": sandbox.limits.timeout_s, "tools": ["run_python", "submit"]}


if __name__ == "__main__":
    from forge_rl.envs import serve

    os.environ.setdefault("MAX_CONCURRENT_ENVS", "16")
    serve(CodeToolsEnvironment)
