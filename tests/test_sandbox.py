"""The code sandbox where it is easy to get wrong: a checkout and virtualenv under /tmp (bwrap mounts a tmpfs
there), a server without root in rlimits mode (its programs share its uid), an interpreter that cannot run
programs at all (every program would silently score 0), and a checkout only its owner can read (the checks run
as another user must not import from it)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path

import pytest

from apps.coder.isolation import allowlist, bwrap_argv, default_python, detect_isolation
from apps.coder.sandbox import Sandbox
from forge_rl.envs.local import launch_local
from forge_rl.rollout.env_client import EnvError
from tests.test_env_code_task import episode

ROOT = Path(__file__).resolve().parent.parent


def test_a_sandbox_that_cannot_run_a_program_stops_its_server_at_start():
    """An interpreter that prints nothing (/bin/true runs `-c pass` fine): the sandbox refuses to be made,
    and the server fails at start saying why, instead of grading every program as a wrong answer."""
    with pytest.raises(RuntimeError, match="sandbox cannot run programs with /bin/true"):
        Sandbox(python="/bin/true")
    with pytest.raises(RuntimeError, match="sandbox cannot run programs with /bin/true"):
        launch_local("apps.coder.env", env={"SANDBOX_PYTHON": "/bin/true"}, timeout_s=180)


@pytest.mark.skipif(detect_isolation() != "bwrap", reason="bubblewrap cannot make a sandbox on this host")
def test_bwrap_works_from_a_checkout_and_virtualenv_under_tmp(monkeypatch):
    """A copy of the project under /tmp and a virtualenv in it whose interpreter runs the programs, as
    `make install` in a clone under /tmp makes; the server started from there: the sandbox is bwrap (not a
    silent fall back to rlimits), a scratch run prints, a right answer scores 1, a wrong one 0. The program sees
    neither the checkout nor its virtualenv: bwrap runs the base interpreter, shown with its standard library only."""
    top = Path(tempfile.mkdtemp(prefix="forge_rl_checkout_", dir="/tmp"))
    os.chmod(top, 0o755)  # as a clone's: the runs' uids must reach the interpreter (pytest's tmp_path is 0700)
    try:
        checkout = top / "repo"
        for package in ("apps", "forge_rl"):
            shutil.copytree(ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
        # From the interpreter the sandbox's uids can run (default_python); without pip: programs need none.
        subprocess.run([default_python(), "-m", "venv", "--without-pip", str(checkout / ".venv")], check=True, timeout=120)
        monkeypatch.chdir(checkout)
        env = {"PYTHONPATH": str(checkout), "SANDBOX_PYTHON": str(checkout / ".venv" / "bin" / "python")}
        with launch_local("apps.coder.env", env=env, max_concurrent_envs=2, timeout_s=180) as server:
            assert json.load(urllib.request.urlopen(f"{server.url}/health", timeout=30))["isolation"] == "bwrap"
            shown = f"0\nimport os, sys\nprint(6 * 7, os.path.exists({str(top)!r}), sys.prefix.startswith({str(top)!r}))"
            seen = episode(server, {"seed": 3, "max_turns": 2}, {"code": shown}, {"code": "x+7", "submit": True})
            assert seen[1]["stdout"] == "42 False False\n" and seen[1]["exit_code"] == 0, seen[1]
            assert seen[2]["reward"] == 1.0
            assert episode(server, {"seed": 3}, {"code": "x+7 if 0 else x", "submit": True})[-1]["reward"] == 0.0
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(detect_isolation() != "bwrap", reason="bubblewrap cannot make a sandbox on this host")
def test_bwrap_shows_the_interpreters_own_packages_folder_empty():
    """An interpreter whose site-packages lies inside its standard library's folder (pyenv's; the python images'
    /usr/local/lib/python3.X): bwrap shows that folder empty, as if nothing were installed, and the standard library
    imports. With this test's own interpreter (its base: bwrap runs no virtualenv), in bwrap as this user."""
    executable, shown = allowlist(sys.executable)
    ask = "import site, sys; print(site.getsitepackages([sys.base_prefix])[0])"
    packages = subprocess.run([executable, "-I", "-c", ask], capture_output=True, text=True, check=True).stdout.strip()
    if not any(packages.startswith(shown[i + 1] + "/") for i, arg in enumerate(shown) if arg == "--ro-bind"):
        pytest.skip(f"this interpreter's packages ({packages}) are outside its standard library's folder")
    program = f"import json, os\ntry:\n    import pytest\nexcept ImportError as e:\n    print(type(e).__name__)\nprint(os.listdir({packages!r}))"
    seen = subprocess.run(bwrap_argv(16, shown) + [executable, "-I", "-c", program], capture_output=True, text=True, timeout=60)
    assert seen.stdout == "ModuleNotFoundError\n[]\n", (seen.stdout[-500:], seen.stderr[-500:])


def as_another_user(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -c script CODE` as a user other than root when the suite runs as root (a uid of this test run's
    own, so no other test's processes share it), else as this user. CODE is a folder holding a copy of
    apps/coder that this user can read: the checkout may be readable by its owner only (a root's /root/..., a
    `mktemp -d` folder), and the script imports the sandbox from CODE, never from the checkout."""
    code = Path(tempfile.mkdtemp(prefix="forge_rl_sandbox_code_"))
    try:
        (code / "apps").mkdir()
        shutil.copy(ROOT / "apps" / "__init__.py", code / "apps")
        shutil.copytree(ROOT / "apps" / "coder", code / "apps" / "coder", ignore=shutil.ignore_patterns("__pycache__"))
        for folder, _, files in os.walk(code):  # whatever the checkout's modes: readable by all
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        root = os.geteuid() == 0
        uid = 2_100_000_000 + os.getpid() % 1_000_000  # above every uid pool of a root server (sandbox.uid_pool)
        user = {"user": uid, "group": uid, "extra_groups": []} if root else {}
        python = default_python() if root else sys.executable  # one that user can run
        return subprocess.run([python, "-c", script, str(code)], capture_output=True, text=True, timeout=180, cwd="/",
                              env={"PATH": os.environ["PATH"], **env}, **user)  # fmt: skip
    finally:
        shutil.rmtree(code, ignore_errors=True)


@pytest.mark.parametrize("mode", sorted({detect_isolation(), "rlimits"}))
def test_a_sandbox_failing_after_its_check_is_reported_and_never_graded(mode):
    """The programs' interpreter goes away after the server's start-up check (as a process limit reached later,
    or anything else that keeps a child from starting): a submission gets an error saying the sandbox failed,
    not a score of 0 (bwrap's exec failing graded as a program that did not load), and nothing is remembered:
    once the interpreter is back, the same right answer scores 1 and the server kept answering throughout."""
    folder = Path(tempfile.mkdtemp(prefix="forge_rl_python_"))
    os.chmod(folder, 0o755)  # the runs' uids must reach the interpreter
    python = folder / "python3"  # a copy, not a link: bwrap runs an interpreter by its real path
    shutil.copy(os.path.realpath(default_python()), python)
    right = {"code": "(x+7)", "submit": True}  # not plain arithmetic: graded in the sandbox, not computed
    try:
        env = {"SANDBOX_ISOLATION": mode, "SANDBOX_PYTHON": str(python), "SANDBOX_TIMEOUT_S": "5"}
        with launch_local("apps.coder.env", env=env, max_concurrent_envs=2, timeout_s=180) as server:
            python.unlink()
            with pytest.raises(EnvError, match="sandbox could not start a program"):
                episode(server, {"seed": 3}, right)
            with pytest.raises(EnvError, match="sandbox could not start a program"):
                episode(server, {"seed": 3, "max_turns": 2}, {"code": "print(1)"})
            shutil.copy(os.path.realpath(default_python()), python)
            assert episode(server, {"seed": 3}, right)[-1]["reward"] == 1.0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# Run by a user other than root: a program in rlimits mode tries to kill the process that made the sandbox,
# read its environment, and survive its run; the script reports what it saw.
NOT_ROOT = textwrap.dedent("""
    import json, os, socket, sys, time
    sys.path.insert(0, sys.argv[1])
    from apps.coder.grading import grade
    from apps.coder.sandbox import Limits, Sandbox

    me = os.getpid()
    sandbox = Sandbox(Limits(timeout_s=5), isolation="rlimits")
    listener = socket.create_server(("127.0.0.1", 0))  # as the server's port, or the controller's
    attack = (f"import os, signal, socket, time\\n"
              f"try:\\n    print(open('/proc/{me}/environ').read())\\nexcept OSError as e:\\n    print('refused', type(e).__name__)\\n"
              f"try:\\n    os.kill({me}, signal.SIGKILL)\\nexcept OSError as e:\\n    print('refused', type(e).__name__)\\n"
              f"try:\\n    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)\\n    print('connected')\\n"
              f"except OSError as e:\\n    print('refused', type(e).__name__)\\n"
              f"if os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\n")
    run = sandbox.run(attack)
    graded = grade(sandbox, attack + "def f(x):\\n    return x\\n", "f", ["assert f(1) == 1"])

    def alive_program(pid):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            mine = os.stat(f"/proc/{pid}").st_uid == os.getuid()  # (other users' sandboxes may run meanwhile)
            return mine and state != "Z" and b"json.loads(sys.stdin" in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            return False

    deadline = time.monotonic() + 10  # killed processes may take a moment to go
    while (survivors := [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me and alive_program(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [open(f"/proc/{p}/stat").read() for p in survivors if alive_program(p)]
    print(json.dumps({"unshare": sandbox._unshare != [], "stdout": run.stdout, "graded": graded, "survivors": survivors,
                      "secret_seen": "FORGE_SANDBOX_SECRET" in run.stdout}))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no util-linux unshare here")
def test_rlimits_without_root_keeps_the_server_out_of_reach():
    """rlimits mode as a user other than root (a uid of its own, when the suite runs as root): each program runs in
    its own PID namespace (util-linux unshare in a user namespace), so neither a run nor a graded program
    can signal the process that runs the sandbox or read its /proc entries, and nothing outlives a run; and its
    own network namespace: it cannot connect to a port on loopback (it did before #53)."""
    proc = as_another_user(NOT_ROOT, {"FORGE_SANDBOX_SECRET": "1"})
    if proc.returncode == 0 and not json.loads(proc.stdout)["unshare"]:
        pytest.skip("user namespaces are not allowed here: the documented fallback (the server's uid) applies")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    seen = json.loads(proc.stdout)
    assert seen["stdout"].split() == ["refused", "FileNotFoundError", "refused", "ProcessLookupError", "refused", "OSError"], seen
    assert not seen["secret_seen"] and seen["graded"] == [None] and not seen["survivors"], seen


# Run by a user other than root: sandboxes are made (and check themselves) first; then other processes of the
# same user start, as the trainer's and vLLM's do beside a code server launched by the run (hundreds of
# threads); then a program forks, a graded function forks, and a fork bomb counts the processes it got.
CROWDED = textwrap.dedent("""
    import json, os, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from apps.coder.grading import grade
    from apps.coder.isolation import detect_isolation
    from apps.coder.sandbox import Limits, Sandbox

    modes = ["rlimits"] + (["bwrap"] if detect_isolation() == "bwrap" else [])
    sandboxes = {mode: Sandbox(Limits(timeout_s=10), isolation=mode) for mode in modes}
    sandboxes["rlimits, the server's uid"] = Sandbox(Limits(timeout_s=10), isolation="rlimits")
    sandboxes["rlimits, the server's uid"]._unshare = []  # as where user namespaces are not allowed
    crowd = subprocess.Popen([sys.executable, "-c", "import sys, threading, time\\n"
                              "for _ in range(300):\\n    threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\\n"
                              "print('up', flush=True)\\nsys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert crowd.stdout.readline() == "up\\n"
    fork = "import os\\npid = os.fork()\\nif pid == 0:\\n    os._exit(7)\\nprint(os.waitpid(pid, 0)[1] >> 8)"
    forks = "import os\\ndef f(x):\\n    pid = os.fork()\\n    if pid == 0:\\n        os._exit(x)\\n    return os.waitpid(pid, 0)[1] >> 8\\n"
    bomb = ("import os, time\\nn = 0\\nwhile n < 200:\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n        break\\n"
            "    if pid == 0:\\n        time.sleep(60)\\n        os._exit(0)\\n    n += 1\\nprint(n)")
    seen = {}
    for mode, sandbox in sandboxes.items():
        run = sandbox.run(fork)
        seen[mode] = {"fork": run.stdout, "stderr": run.stderr[-500:], "graded": grade(sandbox, forks, "f", ["assert f(3) == 3"]),
                      "bomb": sandbox.run(bomb).stdout}
    crowd.stdin.close()
    crowd.wait()
    print(json.dumps(seen))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no util-linux unshare here")
def test_without_root_a_run_counts_its_own_processes_not_its_users():
    """Without root, a program shares its uid with the server and with whatever else that user runs (a run's
    trainer and vLLM, beside the code server it launched). RLIMIT_NPROC counts every process of a uid, so a limit
    of 32 on top of the server's own threads left no process to a program once they were running: its fork
    failed with EAGAIN, so did `unshare --fork` before it (the start-up check, made before them, passed), and
    each such run graded as a wrong answer. In a user namespace of the run's own the limit counts only the
    run's processes: a program forks, a graded function forks, and a fork bomb still stops at the limit. Where
    user namespaces are not allowed, the limit is what the user runs at the start of the run plus 32."""
    proc = as_another_user(CROWDED, {})
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    for mode, seen in json.loads(proc.stdout).items():
        assert seen["fork"] == "7\n" and seen["graded"] == [None], (mode, seen)
        # Sharing the uid, the bomb also gets the slots of the user's processes that ended after the count
        # (the previous runs' still going away): the bound is looser there.
        assert 16 <= int(seen["bomb"]) < (32 if "uid" not in mode else 64), (mode, seen)


# Run by a user other than root: a file of that user's stands for a task set's data; a program in each mode
# tries to read it.
READABLE = textwrap.dedent("""
    import json, os, shutil, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    from apps.coder.isolation import detect_isolation
    from apps.coder.sandbox import Limits, Sandbox

    data = tempfile.mkdtemp()
    with open(os.path.join(data, "tests.jsonl"), "w") as f:
        f.write("{}")
    modes = ["rlimits"] + (["bwrap"] if detect_isolation() == "bwrap" else [])
    attempt = f"try:\\n    print(open({f.name!r}).read())\\nexcept OSError as e:\\n    print(type(e).__name__)"
    print(json.dumps({m: Sandbox(Limits(timeout_s=10), isolation=m).run(attempt).stdout for m in modes}))
    shutil.rmtree(data)
""")


def test_without_root_a_program_reads_what_its_user_reads_unless_bwrap():
    """Why the code server refuses task sets with hidden data in rlimits mode, without root (the red team covers
    root): a program there runs as the server's user and reads its files; bwrap shows it none of them."""
    proc = as_another_user(READABLE, {})
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    for mode, seen in json.loads(proc.stdout).items():
        assert seen == ("{}\n" if mode == "rlimits" else "FileNotFoundError\n"), (mode, seen)


def test_the_other_user_checks_run_from_a_checkout_only_its_owner_can_read(tmp_path):
    """`make test` in a root's /root/... or a `mktemp -d` folder (mode 0700, as pytest's tmp_path): the checks
    run as another user pass there too. They imported the sandbox from the checkout, which that user cannot
    read (measured: ModuleNotFoundError: No module named 'apps')."""
    if os.geteuid() != 0:
        pytest.skip("the checks run as this user, who can read its checkout")
    checkout = tmp_path / "checkout"
    for folder in ("apps", "forge_rl", "tests"):
        shutil.copytree(ROOT / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", checkout)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-k", "without_root",
                           "tests/test_sandbox.py"], cwd=checkout, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(checkout)})  # fmt: skip
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
