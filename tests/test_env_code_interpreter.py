"""Code-interpreter server on 127.0.0.1: programs are graded out of their process, hostile ones are contained.

Runs against one server per isolation mode: the detected one (bwrap where namespaces work) and
the rlimits-only fallback, so both paths stay tested on a machine that has bubblewrap.
"""

import asyncio
import json
import os
import time
import urllib.request

import psutil
import pytest

from apps.code_agent.agent import TASKS, submission
from apps.coder.isolation import detect_isolation
from apps.coder.sandbox import _HARNESS, uid_pool
from forge_rl.envs.local import launch_local
from forge_rl.rollout.env_client import EnvError, EnvSession
from tests.test_env_code_task import HOSTILE as HOSTILE_SUBMISSIONS

SECRET = "forge-test-secret-6c1f"
TIMEOUT_S = 2
MODES = sorted({detect_isolation(), "rlimits"})


@pytest.fixture(scope="module", params=MODES)
def server(request):
    env = {"SANDBOX_ISOLATION": request.param, "SANDBOX_TIMEOUT_S": str(TIMEOUT_S), "FORGE_TEST_SECRET": SECRET}
    with launch_local("apps.coder.interpreter:CodeInterpreterEnvironment", env=env, max_concurrent_envs=4) as srv:
        srv.mode = request.param
        yield srv


def execute(server, code, entry_point=None, tests=()):
    """One step: a scratch run, or with (arguments, value) tests of `entry_point` a graded submission."""
    action = {"code": code}
    if tests:
        action.update(entry_point=entry_point, tests=[{"args": a, "expected": v} for a, v in tests])
    return step(server, action)


def step(server, action):
    async def go():
        async with EnvSession(server.url, timeout_s=30, restore="none") as session:
            await session.reset()
            return (await session.step(action)).observation

    return asyncio.run(go())


def assert_healthy(server):
    health = json.load(urllib.request.urlopen(f"{server.url}/health", timeout=5))
    assert health["status"] == "healthy" and health["isolation"] == server.mode
    assert server.proc.poll() is None
    obs = execute(server, "print(6 * 7)")
    assert obs["stdout"] == "42\n" and obs["exit_code"] == 0 and not obs["timed_out"]
    deadline = time.monotonic() + 2  # SIGKILLed processes may take a moment to be reaped
    while sandbox_processes(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes(server), sandbox_processes(server)


def sandbox_processes(server):
    """Live (non-zombie) processes of the server's sandboxed programs: there must be none between runs.
    Found by the uid (a root server gives each run one of its pool, >= 2e9) or, whatever the uid, by the
    harness in their command line, which their forked children (daemons included) keep, among the server's
    descendants (a non-root server runs each program in its own PID namespace, which ends with it). Only
    this server's: other tests' servers may run programs meanwhile."""
    pool = uid_pool(server.proc.pid)
    family = {str(p.pid) for p in psutil.Process(server.proc.pid).children(recursive=True)}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode("utf-8", "replace")
        except OSError:
            continue
        uid = int(status.split("Uid:")[1].split()[0])
        state = status.split("State:")[1].split()[0]
        if (uid in pool or (_HARNESS in cmdline and pid in family)) and state != "Z":
            found.append((pid, uid, state))
    return found


def test_the_leftover_check_sees_a_running_program(server):
    """sandbox_processes() must see a sandboxed program, under whatever uid the server runs it."""
    async def go():
        async with EnvSession(server.url, timeout_s=30, restore="none") as session:
            await session.reset()
            running = asyncio.create_task(session.step({"code": "import time\ntime.sleep(1.5)", "tests": []}))
            seen = []
            while not running.done():
                seen.append(bool(sandbox_processes(server)))
                await asyncio.sleep(0.1)
            await running
            return seen

    assert any(asyncio.run(go()))
    assert_healthy(server)


def test_correct_program_passes_its_tests(server):
    code = "def add(a, b):\n    return a + b\nprint('defined')"
    obs = execute(server, code, "add", [([2, 3], 5), ([-1, 1], 0)])
    assert obs["tests_passed"] == 2 and obs["tests_total"] == 2 and obs["reward"] == 1.0 and obs["done"]
    assert obs["isolation"] == server.mode
    words = execute(server, "def rev(s):\n    return s[::-1]", "rev", [(["abc"], "cba"), ([[1, 2]], [2, 1]), ([{"a": 1}], None)])
    assert words["test_errors"][:2] == [None, None] and "TypeError" in words["test_errors"][2], words


def test_reward_is_the_fraction_of_tests_passed(server):
    obs = execute(server, "def sq(x):\n    return x * x if x < 3 else 0", "sq", [([2], 4), ([3], 9)])
    assert obs["reward"] == 0.5 and obs["test_errors"][0] is None and "AssertionError" in obs["test_errors"][1]
    broken = execute(server, "def f(:\n  pass", "f", [([], None)])
    assert broken["reward"] == 0.0 and "SyntaxError" in broken["test_errors"][0]


def test_tests_need_the_function_they_call(server):
    with pytest.raises(EnvError, match="entry_point"):
        step(server, {"code": "def f():\n    return 1", "tests": [{"args": [], "expected": 1}]})


@pytest.mark.parametrize("name", sorted(HOSTILE_SUBMISSIONS))
def test_the_code_agent_cannot_forge_its_reward(server, name):
    """apps/code_agent's submission, graded out of the program's process: each of the code-task server's
    hostile programs (among them an object equal to anything, and result lines written to every descriptor
    before os._exit(0)) scores 0 on the agent's task, where a correct answer scores 1."""
    seed = 3  # square(x): its values 9 and 4 are no constant's
    assert "square" in TASKS[seed % len(TASKS)][0]
    assert step(server, submission("def square(x):\n    return x * x", seed))["reward"] == 1.0
    obs = step(server, submission(f"def f(x):\n    return 0\n{HOSTILE_SUBMISSIONS[name]}\nsquare = f\n", seed))
    assert obs["done"] and obs["reward"] == 0.0 and obs["tests_passed"] == 0, obs
    assert_healthy(server)


def test_scratch_run_without_tests_is_not_graded(server):
    obs = execute(server, "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert obs["stdout"] == "out\n" and "err" in obs["stderr"] and obs["exit_code"] == 3
    assert obs["reward"] is None and not obs["done"] and obs["tests_total"] is None


def test_each_run_gets_a_fresh_empty_working_directory(server):
    assert execute(server, "open('left_behind.txt', 'w').write('x')")["exit_code"] == 0
    obs = execute(server, "import os; print(os.path.exists('left_behind.txt'))")
    assert obs["stdout"] == "False\n"


HOSTILE = {
    "infinite_loop": ("while True:\n    pass", lambda o: o["timed_out"]),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", lambda o: o["timed_out"] or o["exit_code"] != 0),
    "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))", lambda o: "MemoryError" in o["stderr"] or o["timed_out"]),
    "huge_stdout": ("import sys\nsys.stdout.write('x' * (100 << 20))", lambda o: o["truncated"] and len(o["stdout"]) <= 64 << 10),
    "deep_recursion": ("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)", lambda o: o["timed_out"] or o["exit_code"] != 0),
    "daemon_child": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('bye')", lambda o: o["stdout"] == "bye\n"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(server, name):
    code, contained = HOSTILE[name]
    obs = execute(server, code)
    assert contained(obs), {k: obs[k] for k in ("exit_code", "timed_out", "truncated", "stderr")}
    assert_healthy(server)


def test_writing_outside_the_working_directory_fails(server, tmp_path):
    targets = [str(tmp_path / "escaped.txt"), "/etc/forge_escaped", os.path.join(os.getcwd(), "forge_escaped")]
    code = "import sys\nfor path in %r:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n    except OSError as e:\n        print('refused', type(e).__name__)" % targets
    obs = execute(server, code)
    assert "WROTE" not in obs["stdout"] and obs["stdout"].count("refused") == 3
    assert not any(os.path.exists(t) for t in targets)
    assert_healthy(server)


def test_server_environment_does_not_leak(server):
    code = f"import os\nprint(dict(os.environ))\ntry:\n    print(open('/proc/{server.proc.pid}/environ').read())\nexcept OSError as e:\n    print('refused', e)"
    obs = execute(server, code)
    assert SECRET not in obs["stdout"] + obs["stderr"] and "refused" in obs["stdout"]
    assert "FORGE_TEST_SECRET" not in obs["stdout"]
    assert_healthy(server)


def test_killing_the_server_fails(server):
    obs = execute(server, f"import os, signal\nfor pid in (os.getppid(), {server.proc.pid}):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)")
    assert server.proc.poll() is None
    assert_healthy(server)


def test_network_socket(server):
    port = int(server.url.rsplit(":", 1)[1])
    code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('connected')\nexcept OSError as e:\n    print('blocked', type(e).__name__)"
    obs = execute(server, code)
    if server.mode == "bwrap":
        assert obs["stdout"].startswith("blocked"), obs
    else:  # documented: rlimits mode has the server's network; Kubernetes adds a NetworkPolicy
        assert obs["stdout"].strip() in ("connected", "blocked ConnectionRefusedError")
    assert_healthy(server)


def test_sigterm_stops_the_server_with_a_session_open_and_a_step_in_flight():
    """kubectl delete or `timeout` send SIGTERM: the server stops within its grace period even while a
    session is open and a step runs a program that would take a minute (uvicorn alone waits for it)."""
    import signal

    from forge_rl.envs import SHUTDOWN_GRACE_S

    with launch_local("apps.coder.interpreter:CodeInterpreterEnvironment", env={"SANDBOX_TIMEOUT_S": "60"}) as server:

        async def go():
            async with EnvSession(server.url, timeout_s=120, restore="none") as session:
                await session.reset()
                step = asyncio.ensure_future(session.step({"code": "import time\ntime.sleep(60)"}))
                await asyncio.sleep(1)
                server.proc.send_signal(signal.SIGTERM)
                start = time.monotonic()
                while server.proc.poll() is None and time.monotonic() - start < SHUTDOWN_GRACE_S + 20:
                    await asyncio.sleep(0.1)
                await asyncio.gather(step, return_exceptions=True)
                return time.monotonic() - start

        elapsed = asyncio.run(go())
        assert server.proc.poll() is not None, f"still serving {elapsed:.0f} s after SIGTERM"
