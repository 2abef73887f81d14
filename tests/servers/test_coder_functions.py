"""The code server's `functions` task set and its Task API splits (in-process, in the servers' virtualenv)."""

import pytest

from apps.coder import functions
from apps.coder.env import CodeTaskAction, CodeTaskEnvironment, verdict
from apps.coder.task_sets import split_tasks

# Hand-written solutions of a few kinds, one per group of the set: each passes every variant's hidden tests.
SOLUTIONS = {
    "add": "def {name}(n):\n    return n + {k}\n",
    "divisible": "def {name}(n):\n    return n % {k} == 0\n",
    "count_letter": "def {name}(s):\n    return s.count('{c}')\n",
    "total": "def {name}(xs):\n    return sum(xs)\n",
    "is_prime": "def {name}(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "gcd": "import math\ndef {name}(a, b):\n    return math.gcd(a, b)\n",
}


def constants(name: str) -> dict:
    word = name.split("_")[-1]
    return {"name": name, "k": functions.WORDS.index(word) if word in functions.WORDS else 0, "c": word}


def test_splits_are_fixed_disjoint_and_hold_out_whole_kinds():
    splits = functions.splits()
    train, held = splits["train"], splits["eval"]
    assert len(train) + len(held) >= 200 and len(held) >= 40
    ids = [t.task_id for t in train + held]
    assert len(set(ids)) == len(ids)  # no problem twice, none in both splits
    assert {t.statement for t in train}.isdisjoint(t.statement for t in held)
    train_kinds, held_kinds = {t.kind for t in train}, {t.kind for t in held}
    assert set(functions.HELD_OUT) <= held_kinds and train_kinds.isdisjoint(functions.HELD_OUT)
    assert len(held_kinds - train_kinds) == len(functions.HELD_OUT) >= 6
    assert all(len(t.tests) >= 5 and t.entry_point in t.statement for t in train + held)
    assert [t.task_id for t in functions.splits.__wrapped__()["eval"]] == [t.task_id for t in held]  # same order each time


def test_task_api_serves_each_split_by_index_and_never_shows_the_tests():
    env = CodeTaskEnvironment()
    assert env.list_splits() == ["train", "eval", "humaneval_train", "humaneval_eval"]
    assert env.num_tasks("eval") == len(functions.splits()["eval"]) and env.num_tasks("nope") == 0
    task = split_tasks()["eval"][3]
    obs = env.reset(split="eval", index=3)
    assert obs.task_id == task.task_id == env.get_task("eval", 3)["id"] and obs.statement == task.statement
    assert obs.task_set == "functions" and not any(test in obs.model_dump_json() for test in task.tests)
    with pytest.raises(ValueError, match="split 'eval' has tasks 0 to"):
        env.reset(split="eval", index=10_000)
    with pytest.raises(ValueError, match="no split 'test'"):
        env.reset(split="test", index=0)
    assert env.reset(seed=5, task_set="functions").task_id == split_tasks()["train"][5].task_id


@pytest.mark.parametrize("kind", sorted(SOLUTIONS))
def test_a_right_function_passes_every_hidden_test_and_a_wrong_one_fails(kind):
    env = CodeTaskEnvironment()
    tasks = [(s, i, t) for s in ("train", "eval") for i, t in enumerate(split_tasks()[s]) if t.task_id.split("/")[1] == kind]
    assert tasks
    for split, index, task in tasks[:3]:
        env.reset(split=split, index=index, partial_credit=False)
        right = SOLUTIONS[kind].format(**constants(task.entry_point))
        obs = env.step(CodeTaskAction(code=right, submit=True))
        assert (obs.reward, obs.verdict) == (1.0, "passed"), (task.task_id, obs.tests_passed, obs.tests_total)
        env.reset(split=split, index=index, partial_credit=False)
        obs = env.step(CodeTaskAction(code=right.replace("return ", "return not "), submit=True))
        assert (obs.reward, obs.verdict) == (0.0, "failed"), task.task_id


def test_verdicts_name_answers_that_are_not_a_function_to_test():
    assert verdict("def add_two(n):\n    return n +\n", "add_two", (0, 10)) == "syntax_error"
    assert verdict("def add_to(n):\n    return n + 2\n", "add_two", (0, 10)) == "no_function"
    assert verdict("add_two = lambda n: n + 2\n", "add_two", (10, 10)) == "passed"
    assert verdict("add_two = lambda n: n\n", "add_two", (0, 10)) == "failed"
    env = CodeTaskEnvironment()
    env.reset(split="train", index=0)
    obs = env.step(CodeTaskAction(code="def something_else(n):\n    return n\n", submit=True))
    assert obs.verdict == "no_function" and obs.reward == 0.0
