"""Where sandboxed programs can run on this host: the interpreter that runs them, the isolation bubblewrap
can give (sandbox.py's two modes), the folders under /tmp that interpreter needs (a virtualenv in a clone
there, which bwrap's tmpfs on /tmp would hide), and a PID namespace of its own without root (`unshare`).
Each is probed by starting that interpreter, once, when a Sandbox is made.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys


def _executable_by_anyone(path: str) -> bool:
    """Whether a different uid can run `path`: every parent searchable, the file executable."""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)


def default_python() -> str:
    """SANDBOX_PYTHON if set; else this interpreter if another uid can run it; else the system's."""
    if os.environ.get("SANDBOX_PYTHON"):
        return os.environ["SANDBOX_PYTHON"]
    if os.geteuid() != 0 or _executable_by_anyone(sys.executable):
        return sys.executable
    return "/usr/bin/python3"


def bwrap_argv(tmpfs_mb: int, hidden: tuple[str, ...] = (), visible: tuple[str, ...] = ()) -> list[str]:
    """`hidden`: folders the program must not read (an empty tmpfs is mounted over each, last). `visible`:
    folders under /tmp the interpreter needs, bound back read-only over the working directory's tmpfs."""
    return [
        "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp",
        *(arg for path in visible for arg in ("--ro-bind", path, path)),
        *(arg for path in hidden for arg in ("--tmpfs", path)),
        "--chdir", "/tmp", "--unshare-all", "--die-with-parent", "--new-session",
    ]  # fmt: skip


def interpreter_dirs_under_tmp(python: str) -> tuple[str, ...]:
    """The folders of `python` (its own, its prefix and base prefix, symlinks followed) that lie under /tmp,
    outermost only: a checkout under /tmp with its virtualenv, whose interpreter bwrap's tmpfs would hide."""
    try:
        found = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                               capture_output=True, text=True, timeout=60).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        found = []
    paths = {os.path.dirname(os.path.abspath(python)), os.path.dirname(os.path.realpath(python)), *found}
    paths |= {os.path.realpath(p) for p in paths}
    under = sorted(p for p in paths if p.startswith("/tmp/"))
    return tuple(p for p in under if not any(p.startswith(q + "/") for q in under))


def own_pid_namespace(python: str) -> list[str]:
    """The command prefix that runs a program in a PID namespace (and /proc) of its own without root
    (util-linux `unshare` in a user namespace), or [] where this host does not allow it."""
    prefix = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
    try:
        proc = subprocess.run(prefix + [python, "-I", "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return prefix if proc.returncode == 0 and proc.stdout.strip() == "1" else []


def detect_isolation(python: str | None = None) -> str:
    """'bwrap' if bubblewrap can start a sandbox here (as the uid runs will use), else 'rlimits'."""
    if shutil.which("bwrap") is None:
        return "rlimits"
    user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    python = python or default_python()
    try:
        proc = subprocess.run(
            bwrap_argv(1, visible=interpreter_dirs_under_tmp(python)) + [python, "-c", "pass"],
            capture_output=True, timeout=10, env={"PATH": "/usr/bin:/bin"}, **user,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "rlimits"
    return "bwrap" if proc.returncode == 0 else "rlimits"
