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

from apps.coder.isolation import default_python, detect_isolation
from apps.coder.sandbox import Sandbox
from forge_rl.envs.local import launch_local
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
    silent fall back to rlimits), a scratch run prints, a right answer scores 1, a wrong one 0."""
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
            seen = episode(server, {"seed": 3, "max_turns": 2}, {"code": "0\nimport sys\nprint(6 * 7, sys.prefix)"},
                           {"code": "x+7", "submit": True})
            assert seen[1]["stdout"] == f"42 {checkout / '.venv'}\n" and seen[1]["exit_code"] == 0, seen[1]
            assert seen[2]["reward"] == 1.0
            assert episode(server, {"seed": 3}, {"code": "x+7 if 0 else x", "submit": True})[-1]["reward"] == 0.0
    finally:
        shutil.rmtree(top, ignore_errors=True)


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


# Run by a user other than root: a program in rlimits mode tries to kill the process that made the sandbox,
# read its environment, and survive its run; the script reports what it saw.
NOT_ROOT = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    from apps.coder.grading import grade
    from apps.coder.sandbox import Limits, Sandbox

    me = os.getpid()
    sandbox = Sandbox(Limits(timeout_s=5), isolation="rlimits")
    attack = (f"import os, signal, time\\n"
              f"try:\\n    print(open('/proc/{me}/environ').read())\\nexcept OSError as e:\\n    print('refused', type(e).__name__)\\n"
              f"try:\\n    os.kill({me}, signal.SIGKILL)\\nexcept OSError as e:\\n    print('refused', type(e).__name__)\\n"
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
    can signal the process that runs the sandbox or read its /proc entries, and nothing outlives a run."""
    proc = as_another_user(NOT_ROOT, {"FORGE_SANDBOX_SECRET": "1"})
    if proc.returncode == 0 and not json.loads(proc.stdout)["unshare"]:
        pytest.skip("user namespaces are not allowed here: the documented fallback (the server's uid) applies")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    seen = json.loads(proc.stdout)
    assert seen["stdout"].split() == ["refused", "FileNotFoundError", "refused", "ProcessLookupError"], seen
    assert not seen["secret_seen"] and seen["graded"] == [None] and not seen["survivors"], seen


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
