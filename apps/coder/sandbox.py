"""Run untrusted Python in a fresh child process, never in the server's interpreter.

Every call of `Sandbox.run` starts one child, feeds it the program on stdin, and reads stdout
and stderr until it exits or the wall clock runs out. Two isolation modes, picked once at construction:

  bwrap    bubblewrap with every namespace unshared, showing the program only what running Python needs
           (isolation.allowlist: the interpreter, its standard library, the shared libraries it maps, read-only),
           no network, its own PID namespace (the server is invisible, killing bwrap kills every descendant),
           and one place to write: a private size-capped tmpfs at /tmp (the working directory; /dev/shm is a
           link to it) that vanishes with the run.
  rlimits  a plain child in its own session, working in a fresh temporary directory removed
           afterwards. Network and filesystem are those of the server's user (or, as root, of a uid that is
           no one's: it reads what every user may, and what it leaves in folders anyone may write is removed
           after the run). It hides nothing: task sets with hidden data are refused there (env.py).

Both modes apply rlimits (CPU seconds, address space, file size, processes, no core files) and a
scrubbed environment. Run as root, each call also gets its own unused uid, so RLIMIT_NPROC (which
root ignores) holds, the server's files and /proc entries are out of reach, and leftover
processes of the run are swept with `kill(-1)` as that uid. Without root, rlimits mode gives each
call its own PID namespace and /proc, and network, where user namespaces allow (`unshare`): the server is out of
its reach; where not, it shares the server's uid and can signal it. A sandbox checks itself when made
(a known program must run and print, or it raises).

RLIMIT_NPROC counts the processes of the run's uid in its innermost user namespace, so the child lowers it
itself (the prologue, before the caller's code), in the namespace bwrap or unshare made: else, without
root, every process of the server's user (a run's trainer and vLLM) counts and leaves a program no fork.
The prologue then writes one byte: a child that never writes it did not start (a process limit reached,
the interpreter gone), a failure of the sandbox, not the program: retried, then raised as SandboxError.

Grading is not `run`'s: a program can forge anything its own process reports. `process` is the
piece for grading out of the program's process (grading.py, used by both servers).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import resource
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from apps.coder.isolation import allowlist, bwrap_argv, default_python, detect_isolation, own_pid_namespace, writable_by_anyone

# Runs first in every child, before the caller's harness: the process limit (see the module's docstring),
# stderr to /dev/null where the caller discards it, then the byte that says the child started.
_PROLOGUE = """import os, resource
resource.setrlimit(resource.RLIMIT_NPROC, ({nproc}, {nproc}))
if {discard_stderr}:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
os.write(1, b"\\0")
"""
_STARTED = b"\0"
START_ATTEMPTS = 3  # a child that did not start is tried again, after 0.5 s, then 1 s
START_LIMIT_S = 30.0  # the most a child may take to start (the program's timeout starts after)

# Runs inside the child: reads the program (a JSON string) from stdin and runs it as __main__.
_HARNESS = r"""
import json, os, sys
code = json.loads(sys.stdin.read()); sys.stdin.close()
ns = {"__name__": "__main__", "__builtins__": __builtins__}
status = 0
try:
    exec(compile(code, "main.py", "exec"), ns)
except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
except BaseException:
    import traceback; traceback.print_exc(); status = 1
sys.stdout.flush(); sys.stderr.flush()
os._exit(status)
"""

_UID_POOL_SIZE = 256
_UID_BASE = 2_000_000_000


def uid_pool(pid: int) -> range:
    """The uids a root server with this pid gives its runs: far above any login or subuid range (those start
    at 1000 and 100000), spread by pid so two servers on one host do not share, and sweep, each other's."""
    base = _UID_BASE + (pid % 4096) * _UID_POOL_SIZE
    return range(base, base + _UID_POOL_SIZE)


class SandboxError(RuntimeError):
    """The sandbox could not start a program: a failure of the host, not of the program, never a result."""


@dataclass
class Limits:
    """Per-run limits. cpu_s defaults to the wall-clock timeout rounded up, plus one."""

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    max_processes: int = 32  # RLIMIT_NPROC: this run's processes (and threads), the interpreter included
    tmpfs_mb: int = 64  # working directory size in bwrap mode
    output_bytes: int = 64 * 1024  # stdout/stderr kept per stream; the rest is dropped
    output_kill_bytes: int = 16 * 1024 * 1024  # total output past which the run is killed


@dataclass
class ExecutionResult:
    """What one run produced."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by the timeout; negative = killed by that signal
    timed_out: bool
    truncated: bool
    duration_s: float = 0.0


def _environment(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip


def _tasks_of(uid: int) -> int:
    """Processes and threads of `uid` (real uid) on this host now: what RLIMIT_NPROC counts for it."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:  # (a process gone meanwhile)
            status = f.read()
            if int(status.split("\nUid:")[1].split()[0]) == uid:
                total += int(status.split("\nThreads:")[1].split()[0])
    return total


def _wait_for_namespace(info_r: int, limit_s: float = 10.0) -> None:
    """Block until bwrap's PID namespace is empty (its init gone or a zombie; the kernel kills
    the rest first). Killed fork bombs take a moment; until then they count against RLIMIT_NPROC."""
    os.set_blocking(info_r, False)
    try:
        pid = int(json.loads(os.read(info_r, 4096) or b"{}").get("child-pid", 0))
    except (OSError, ValueError, AttributeError):
        pid = 0
    finally:
        os.close(info_r)
    deadline = time.monotonic() + limit_s
    while pid and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.01)


def _remove_files_of(uid: int, folder: str) -> None:
    """Everything `uid` owns in `folder` and in its subfolders anyone may write (where only `uid` could have put
    it): else a run as root could fill /dev/shm, host memory, beyond its run, or leave a file for the next run
    given the same uid to read."""
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in list(entries):
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == uid:
                    shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
                elif entry.is_dir(follow_symlinks=False) and info.st_mode & 0o002:
                    _remove_files_of(uid, entry.path)


class Sandbox:
    """Executes programs one child process per call; thread-safe, one Sandbox per server.

    Invariant: when `run` returns, no process of that run is left: with bwrap the PID namespace
    is empty (waited for); in rlimits mode the process group is killed and, as root, the run's
    uid swept with SIGKILL (the kernel may take a moment to reap those). Its working directory
    is gone, and so (as root) is every file its uid left in the folders anyone may write. The uid
    goes back to the pool (FIFO) only after that. Not guaranteed in rlimits mode without root and
    without a PID namespace of its own: a process that leaves the group and sleeps survives the run. A result always comes from a child that started: else SandboxError.
    """

    def __init__(self, limits: Limits | None = None, isolation: str = "auto", python: str | None = None):
        if isolation not in ("auto", "bwrap", "rlimits"):
            raise ValueError(f"isolation must be 'auto', 'bwrap' or 'rlimits', got {isolation!r}")
        self.limits = limits or Limits()
        self.python = python or default_python()
        detected = detect_isolation(self.python)
        if isolation == "bwrap" and detected != "bwrap":
            raise ValueError("isolation='bwrap' but bubblewrap cannot start a sandbox here "
                             "(not installed, or no user namespaces); use 'auto' or 'rlimits'")  # fmt: skip
        self.isolation = detected if isolation == "auto" else isolation
        # bwrap runs the base interpreter of self.python, shown with what it needs and nothing else.
        self.executable, self.shown = allowlist(self.python) if self.isolation == "bwrap" else (self.python, ())
        self._kill = [shutil.which("kill") or "/bin/kill", "-9", "-1"]
        if not os.path.exists(self._kill[0]):  # slim images: do it with the interpreter instead
            self._kill = [self.python, "-c", "import os; os.kill(-1, 9)"]
        self._as_root = os.geteuid() == 0
        self._swept = writable_by_anyone() if self._as_root and self.isolation == "rlimits" else ()
        self._uids: queue.Queue[int] = queue.Queue()
        for uid in uid_pool(os.getpid()):
            self._uids.put(uid)
        self._unshare = own_pid_namespace(self.python) if self.isolation == "rlimits" and not self._as_root else []
        self._check()

    def _check(self) -> None:
        """A known program must run and print: a sandbox that cannot start its interpreter (hidden, or not
        executable by the runs' uid) would grade every program as a wrong answer, silently."""
        try:
            result = self.run("print('forge_rl sandbox check')")
        except SandboxError as e:
            why = str(e)
        else:
            if result.stdout == "forge_rl sandbox check\n" and result.exit_code == 0:
                return
            last = (result.stderr.strip().splitlines() or ["nothing on stderr"])[-1][:300]
            why = f"a known program printed {result.stdout[:100]!r} and exited {result.exit_code}: {last}"
        raise RuntimeError(f"the {self.isolation} sandbox cannot run programs with {self.python} ({why}); "
                           "check SANDBOX_PYTHON and SANDBOX_ISOLATION")

    def _command(self, harness: str, args: list[str], info_w: int, discard_stderr: bool) -> list[str]:
        """`python -I -c <prologue + harness> *args` as this sandbox starts it: in bwrap (which reports on `info_w`),
        or in rlimits mode in a PID namespace of its own where one can be made without root."""
        # Where a run has no uid or user namespace of its own, every process of the server's user counts.
        shared_uid = not self._as_root and self.isolation == "rlimits" and not self._unshare
        nproc = self.limits.max_processes + (_tasks_of(os.getuid()) if shared_uid else 0)
        prologue = _PROLOGUE.format(nproc=nproc, discard_stderr=discard_stderr)
        command = [self.executable, "-I", "-c", prologue + harness, *args]
        if self.isolation == "bwrap":
            return bwrap_argv(self.limits.tmpfs_mb, self.shown) + ["--info-fd", str(info_w)] + command
        return self._unshare + command

    def run(self, code: str, timeout_s: float | None = None) -> ExecutionResult:
        """Run `code` in a fresh child; blocks until it ends or times out. SandboxError if no child started."""
        timeout = min(timeout_s or self.limits.timeout_s, self.limits.timeout_s)
        with self._child(_HARNESS, [], timeout, discard_stderr=False) as proc:
            return self._run(proc, code, timeout)

    @contextlib.contextmanager
    def process(self, harness: str, args: list[str], timeout_s: float | None = None):
        """A started child `python -I -c harness *args` under the same isolation and limits as `run`, for a caller
        that talks to it while it runs (grading.py): yields the Popen, stdin and stdout pipes, stderr discarded.
        On exit the child and everything it started are killed, as after `run`. SandboxError if none started."""
        timeout = min(timeout_s or self.limits.timeout_s, self.limits.timeout_s)
        with self._child(harness, args, timeout, discard_stderr=True) as proc:
            yield proc

    @contextlib.contextmanager
    def _child(self, harness: str, args: list[str], timeout: float, discard_stderr: bool):
        """Yields a child that started (its prologue wrote its byte), trying START_ATTEMPTS times; then cleans up."""
        why = ""
        for attempt in range(START_ATTEMPTS):
            time.sleep(0.5 * attempt)
            uid = self._uids.get() if self._as_root else None
            workdir, proc, info_r = None, None, None
            try:
                if self.isolation == "rlimits":
                    workdir = tempfile.mkdtemp(prefix="forge_sandbox_")
                    if uid is not None:
                        os.chown(workdir, uid, uid)
                info_r, info_w = os.pipe()  # bwrap writes {"child-pid": N}: the namespace's init, seen from here
                user = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
                try:
                    proc = subprocess.Popen(
                        self._command(harness, args, info_w, discard_stderr), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(info_w,) if self.isolation == "bwrap" else (),
                        cwd=workdir or "/", env=_environment(workdir or "/tmp"), start_new_session=True,
                        preexec_fn=self._preexec(timeout), **user,
                    )  # fmt: skip
                except OSError as e:  # rlimits mode: the interpreter did not start, or the server could not fork
                    why = f"{type(e).__name__}: {e}"
                finally:
                    os.close(info_w)
                if proc is not None and not (why := self._not_started(proc)):
                    yield proc
                    return
            finally:
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # bwrap's PID namespace takes the rest
                    proc.wait()
                    for f in (proc.stdin, proc.stdout, proc.stderr):
                        f.close()
                if info_r is not None:
                    _wait_for_namespace(info_r) if proc is not None else os.close(info_r)
                self._release(uid, workdir)
        raise SandboxError(f"the {self.isolation} sandbox could not start a program in {START_ATTEMPTS} tries: {why}")

    def _not_started(self, proc: subprocess.Popen) -> str:
        """'' once the child's prologue wrote its byte; else why it did not (what bwrap, unshare or Python said)."""
        if select.select([proc.stdout], [], [], START_LIMIT_S)[0] and os.read(proc.stdout.fileno(), 1) == _STARTED:
            return ""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.set_blocking(proc.stderr.fileno(), False)
        said = []
        with contextlib.suppress(BlockingIOError):
            said = os.read(proc.stderr.fileno(), 1 << 16).decode("utf-8", "replace").strip().splitlines()
        return said[-1][:300] if said else f"it exited {proc.returncode} before it started, saying nothing"

    def _release(self, uid: int | None, workdir: str | None) -> None:
        if uid is not None:
            # Everything this uid still runs belongs to this run: daemons, fork-bomb leftovers,
            # and (bwrap) a namespace still being torn down after its init was killed.
            subprocess.run(self._kill, user=uid, group=uid, extra_groups=[],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            for folder in self._swept:
                _remove_files_of(uid, folder)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            self._uids.put(uid)

    def _preexec(self, timeout: float):
        """The limits set before bwrap or unshare run (RLIMIT_NPROC is the prologue's)."""
        lim = self.limits
        cpu = lim.cpu_s or math.ceil(timeout) + 1

        def apply() -> None:
            for what, value in (
                (resource.RLIMIT_CPU, cpu),
                (resource.RLIMIT_AS, lim.memory_mb << 20),
                (resource.RLIMIT_FSIZE, lim.file_size_mb << 20),
                (resource.RLIMIT_CORE, 0),
            ):
                resource.setrlimit(what, (value, value))

        return apply

    def _run(self, proc: subprocess.Popen, code: str, timeout: float) -> ExecutionResult:
        start = time.monotonic()
        streams, timed_out, killed_for_output = self._pump(proc, json.dumps(code).encode(), start + timeout)
        exit_code = None if timed_out else proc.returncode
        out, err = bytes(streams["stdout"]), bytes(streams["stderr"])
        truncated = streams["dropped"] > 0
        stderr = err.decode("utf-8", "replace")
        if killed_for_output:
            stderr += f"\n[output exceeded {self.limits.output_kill_bytes} bytes: process killed]"
        if timed_out:
            stderr += f"\n[timed out after {timeout:g} s: process killed]"
        return ExecutionResult(
            stdout=out.decode("utf-8", "replace"), stderr=stderr, exit_code=exit_code,
            timed_out=timed_out, truncated=truncated, duration_s=time.monotonic() - start,
        )  # fmt: skip

    def _pump(self, proc: subprocess.Popen, job: bytes, deadline: float):
        """Feed stdin, drain the outputs (keeping a capped prefix) until exit, timeout or flood.

        Stops when every output is closed, or when the child has exited and what is already in the
        pipes is read (a leftover grandchild holding stdout open must not stretch the run).
        """
        lim = self.limits
        kept = {"stdout": bytearray(), "stderr": bytearray(), "dropped": 0}
        sel = selectors.DefaultSelector()
        for name, fileobj in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            sel.register(fileobj, selectors.EVENT_READ, name)
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        sent, total, timed_out, flooded = 0, 0, False, False
        try:
            while len(sel.get_map()) > (1 if sent < len(job) else 0) and not flooded:
                exited = proc.poll() is not None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                ready = sel.select(0 if exited else min(remaining, 0.1))
                if exited and not any(key.data != "stdin" for key, _ in ready):
                    break
                for key, _ in ready:
                    if key.data == "stdin":
                        try:
                            sent += os.write(key.fd, job[sent : sent + 65536])
                        except BlockingIOError:
                            pass
                        except BrokenPipeError:
                            sent = len(job)
                        if sent >= len(job):
                            sel.unregister(key.fileobj)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(chunk)
                    buf = kept[key.data]
                    room = max(0, lim.output_bytes - len(buf))
                    buf += chunk[:room]
                    kept["dropped"] += max(0, len(chunk) - room)
                    flooded = total > lim.output_kill_bytes
            if not timed_out and not flooded:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            sel.close()
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # bwrap's PID namespace takes the rest
                except ProcessLookupError:
                    pass
            proc.wait()
        return kept, timed_out, flooded
