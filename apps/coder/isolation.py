"""Where sandboxed programs can run on this host: the interpreter that runs them, what a bwrap sandbox shows them
(an allowlist computed from that interpreter), the isolation bubblewrap can give (sandbox.py's two modes), the
folders any user may write in (where a run as root must sweep its uid's files), and a PID namespace of its own
without root (`unshare`). Each is probed by starting that interpreter, once, when a Sandbox is made.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from functools import lru_cache


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


# Run by the interpreter with -I -S, so sys.path is its standard library alone (no site-packages, no virtualenv's):
# it imports every extension module of that library, then lists the folders of every file mapped into it (the shared
# libraries those modules and the interpreter link, the locale archive) but the interpreter itself.
_ASK = r"""
import json, os, site, sys
stdlib = [os.path.realpath(p) for p in sys.path if os.path.isdir(p)]
for folder in stdlib:
    for name in os.listdir(folder):
        if name.endswith(".so"):
            try:
                __import__(name.split(".")[0])
            except Exception:
                pass
executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
mapped = {os.path.realpath(line.split(None, 5)[5].strip()) for line in open("/proc/self/maps") if len(line.split(None, 5)) == 6}
libraries = {os.path.dirname(p) for p in mapped if p.startswith("/") and os.path.isfile(p) and p != executable}
packages = site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])
print("\n" + json.dumps({"executable": executable, "shown": sorted({*stdlib, *libraries}), "packages": packages}))
"""
DEVICES = ("null", "zero", "full", "random", "urandom")


def elf_loader(executable: str) -> str | None:
    """The dynamic loader a 64-bit ELF executable names (PT_INTERP), which the kernel opens by that very path."""
    with open(executable, "rb") as f:
        data = f.read(1 << 16)
    if data[:5] != b"\x7fELF\x02":
        return None
    order = "<" if data[5] == 1 else ">"
    (start,), (size, count) = struct.unpack_from(order + "Q", data, 32), struct.unpack_from(order + "HH", data, 54)
    for header in range(start, start + size * count, size):
        kind, _, offset, _, _, length = struct.unpack_from(order + "IIQQQQ", data, header)
        if kind == 3:
            return data[offset : offset + length].rstrip(b"\0").decode()
    return None


def symlinks_on_the_way(path: str) -> list[tuple[str, str]]:
    """Each symlink met resolving `path`, as (link, target): made again in a sandbox, `path` resolves there as here
    (/lib64/ld-linux-x86-64.so.2 -> usr/lib64/... -> /lib/x86_64-linux-gnu/... on a merged-/usr Debian)."""
    links, done, todo = [], "/", [part for part in path.split("/") if part]
    while todo and len(links) < 40:
        here = os.path.normpath(os.path.join(done, todo.pop(0)))
        if os.path.islink(here):
            target = os.readlink(here)
            links.append((here, target))
            todo = [part for part in target.split("/") if part] + todo
            done = "/" if target.startswith("/") else done
        else:
            done = here
    return links


@lru_cache(maxsize=None)
def allowlist(python: str) -> tuple[str, tuple[str, ...]]:
    """(the interpreter a bwrap sandbox runs, the bwrap arguments showing it read-only and nothing else): its real
    file (a virtualenv's python is its base interpreter's, whose folders are all it needs), its standard library,
    the folders of the shared libraries it maps, the loader by the path the kernel asks for, and ld.so.cache. A
    site-packages inside them is shown empty: packages are not the standard library. RuntimeError if it cannot run."""
    try:
        asked = subprocess.run([python, "-I", "-S", "-W", "ignore", "-c", _ASK], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the sandbox cannot run programs with {python} ({type(e).__name__}: {e})") from None
    try:  # the last line: importing readline may have written a terminal's escape codes before it
        found = json.loads(asked.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        said = (asked.stderr.strip() or "it printed nothing").splitlines()[-1][:300]
        raise RuntimeError(f"the sandbox cannot run programs with {python} (asked where its standard library is: {said})") from None
    executable = found["executable"]
    loader = elf_loader(executable)
    paths = [executable, *found["shown"], *(p for p in ("/etc/ld.so.cache",) if os.path.exists(p))]
    links = symlinks_on_the_way(loader) if loader else []
    paths += [os.path.realpath(loader)] if loader else []
    outermost = sorted(p for p in set(paths) if not any(p.startswith(q + "/") for q in paths))
    emptied = [p for p in found["packages"] if os.path.isdir(p) and any(p.startswith(q + "/") for q in outermost)]
    return executable, (
        *(arg for path in outermost for arg in ("--ro-bind", path, path)),
        *(arg for link, target in dict(links).items() for arg in ("--symlink", target, link)),
        *(arg for path in emptied for arg in ("--tmpfs", path, "--remount-ro", path)),
    )  # fmt: skip


def bwrap_argv(tmpfs_mb: int, shown: tuple[str, ...]) -> list[str]:
    """bubblewrap with every namespace unshared, showing `shown` (allowlist's arguments) read-only, its own /proc,
    a few devices, and one place to write: a tmpfs of `tmpfs_mb` at /tmp, which /dev/shm is a link to. The rest of
    the tree is bwrap's empty root, made read-only last (writable, it would be a tmpfs without a cap)."""
    return [
        "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
        "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp", "--proc", "/proc",
        *(arg for name in DEVICES for arg in ("--dev-bind", f"/dev/{name}", f"/dev/{name}")),
        "--symlink", "/tmp", "/dev/shm", "--symlink", "/proc/self/fd", "/dev/fd",
        *shown, "--remount-ro", "/", "--chdir", "/tmp",
    ]  # fmt: skip


def writable_by_anyone() -> tuple[str, ...]:
    """Folders every user may write in (o+w): those within two levels of / (/tmp, /var/tmp, /dev/shm, /run/lock, and
    what lies in /tmp) and every mount point. A root server's run has a uid of its own, which can leave files only
    there, in their world-writable subfolders, and in its working directory."""
    found, level = set(), ["/"]
    for _ in range(2):
        below = []
        for folder in level:
            try:
                entries = [e for e in os.scandir(folder) if e.is_dir(follow_symlinks=False) and e.path not in ("/proc", "/sys")]
            except OSError:
                continue
            below += [e.path for e in entries]
            found |= {e.path for e in entries if e.stat(follow_symlinks=False).st_mode & stat.S_IWOTH}
        level = below
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    found |= {p for p in points if not p.startswith(("/proc", "/sys")) and os.path.isdir(p) and os.stat(p).st_mode & stat.S_IWOTH}
    return tuple(sorted(found))


def own_pid_namespace(python: str) -> list[str]:
    """The command prefix that runs a program in a PID namespace (and /proc) of its own without root (util-linux
    `unshare` in a user namespace), and a network namespace (loopback down: no server, no controller), or []
    where this host does not allow it."""
    prefix = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net"]
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
    try:
        executable, shown = allowlist(python or default_python())
        proc = subprocess.run(bwrap_argv(1, shown) + [executable, "-c", "pass"],
                              capture_output=True, timeout=10, env={"PATH": "/usr/bin:/bin"}, **user)  # fmt: skip
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return "rlimits"
    return "bwrap" if proc.returncode == 0 else "rlimits"
