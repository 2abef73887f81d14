"""A sandboxed Python interpreter as an OpenEnv server.

An action is Python source, optionally with tests of one function it defines: calls of `entry_point`
with arguments and the value each must return, all plain JSON. The observation is stdout, stderr,
exit code and whether it timed out, or with tests how many passed; the reward is that fraction. A
step without tests is a scratch run (no reward, episode goes on); a step with tests is the graded
submission and ends the episode.

Every step runs in a fresh child process through `Sandbox` (see sandbox.py for what each
isolation mode gives); nothing the program does reaches this interpreter. A submission is graded out
of the program's process (grading.py, as the code-task server grades): the program only answers the
calls, and each answer is compared here as plain data, so a program cannot forge its result (an
object equal to anything, result lines written to a descriptor, a forced exit). A graded step reports
no output: run the program without tests first to see it. The mode in use is in every observation
(`isolation`) and in /health.

    python -m apps.coder.interpreter --host 0.0.0.0 --port 8000   # reads MAX_CONCURRENT_ENVS
Limits come from SANDBOX_TIMEOUT_S, SANDBOX_MEMORY_MB and SANDBOX_ISOLATION (auto|bwrap|rlimits).
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from apps.coder.grading import grade
from apps.coder.sandbox import Limits, Sandbox

MAX_CODE_CHARS = 200_000
MAX_TESTS = 100


class CallTest(BaseModel):
    """One test: `entry_point(*args)` must return `expected` (compared as plain data: a tuple is not a list)."""

    args: list[Any] = Field(default_factory=list)
    expected: Any = None


class CodeAction(Action):
    code: str = Field(max_length=MAX_CODE_CHARS, description="Python source, run as __main__")
    tests: list[CallTest] = Field(default_factory=list, max_length=MAX_TESTS, description="calls graded out of process")
    entry_point: Optional[str] = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the function the tests call")
    timeout_s: Optional[float] = Field(None, gt=0, description="at most the server's limit")

    @model_validator(mode="after")
    def _tests_name_their_function(self):
        if self.tests and not self.entry_point:  # (a ValueError here would not serialize in OpenEnv's reply)
            raise PydanticCustomError("entry_point", "tests call entry_point: set entry_point to the function they test")
        return self

    def test_sources(self) -> list[str]:
        """The tests as grade() runs them, here in the server: literals of JSON values and a call, nothing
        of the client's code (repr of a JSON value is a Python literal; NaN and infinities fail)."""
        return [f"assert candidate(*{t.args!r}) == {t.expected!r}" for t in self.tests]


class CodeObservation(Observation):
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = Field(None, description="None if killed by the timeout; <0: signal")
    timed_out: bool = False
    truncated: bool = Field(False, description="output past the cap was dropped")
    tests_passed: Optional[int] = None
    tests_total: Optional[int] = None
    test_errors: list[Optional[str]] = Field(default_factory=list, description="None = passed")
    isolation: str = Field("", description="'bwrap' or 'rlimits': how this run was contained")
    duration_s: float = 0.0


@lru_cache(maxsize=1)
def shared_sandbox() -> Sandbox:
    """One Sandbox per server process: isolation is probed once, the uid pool is shared."""
    limits = Limits(
        timeout_s=float(os.environ.get("SANDBOX_TIMEOUT_S", 10)),
        memory_mb=int(os.environ.get("SANDBOX_MEMORY_MB", 1024)),
    )
    return Sandbox(limits, isolation=os.environ.get("SANDBOX_ISOLATION", "auto"))


class CodeInterpreterEnvironment(Environment[CodeAction, CodeObservation, State]):
    """Stateless between steps (each run starts from nothing), so sessions may run concurrently."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._sandbox = shared_sandbox()
        self._state = State()

    @classmethod
    def health_info(cls) -> dict[str, Any]:
        sandbox = shared_sandbox()
        return {"isolation": sandbox.isolation, "timeout_s": sandbox.limits.timeout_s}

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CodeObservation:
        self._state = State(episode_id=episode_id)
        return CodeObservation(isolation=self._sandbox.isolation)

    def step(self, action: CodeAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CodeObservation:
        self._state.step_count += 1
        if action.tests:
            start = time.monotonic()
            errors = grade(self._sandbox, action.code, action.entry_point, action.test_sources(), timeout_s=action.timeout_s)
            passed = sum(e is None for e in errors)
            return CodeObservation(
                tests_passed=passed, tests_total=len(errors), test_errors=errors, isolation=self._sandbox.isolation,
                duration_s=time.monotonic() - start, done=True, reward=passed / len(errors),
            )
        result = self._sandbox.run(action.code, timeout_s=action.timeout_s)
        return CodeObservation(
            stdout=result.stdout,
            stderr=result.stderr,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            truncated=result.truncated,
            isolation=self._sandbox.isolation,
            duration_s=result.duration_s,
            done=False,
        )

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    from forge_rl.envs import serve

    serve(CodeInterpreterEnvironment)
