"""Environment servers started on this host: a run's `env.server: module:Class` launched on 127.0.0.1.

    with launch_local("apps.blackjack.env:BlackJackEnvironment", max_concurrent_envs=16) as server:
        ... server.url ...

A server runs with the server virtualenv's python (`server_python`: env.server_python, else `.venv-env`
beside the training virtualenv, which `make install` makes), never the training one's: openenv 0.10
cannot be installed beside vLLM. The repository is put first on its PYTHONPATH (forge_rl.envs, apps/).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from forge_rl.core.net import free_port

REPOSITORY = Path(__file__).resolve().parents[2]
SERVER_VENV = ".venv-env"


def server_python(configured: str | None = None) -> str:
    """The python environment servers run with: `configured` (env.server_python), else .venv-env/bin/python
    beside the training virtualenv. FileNotFoundError, one line naming the fix, when it is not there."""
    python = Path(configured) if configured else Path(sys.prefix).parent / SERVER_VENV / "bin" / "python"
    if not os.access(python, os.X_OK):
        where = "env.server_python" if configured else f"the server virtualenv {python.parent.parent}"
        raise FileNotFoundError(f"{where}: no python at {python}; run `make install` (it makes {SERVER_VENV}) or set env.server_python")
    return str(python)


_RUNNING: "weakref.WeakSet[LocalServer]" = weakref.WeakSet()


@atexit.register
def _stop_local_servers() -> None:
    """A run that exits without stop() (an exception, Ctrl-C) must not leave servers behind."""
    for server in list(_RUNNING):
        server.stop()


class LocalServer:
    """An environment server subprocess on 127.0.0.1. Owns the process: stop() ends it, and so
    does the normal exit of this interpreter (not a SIGKILL of it)."""

    def __init__(self, target: str, port: int, env: dict[str, str] | None = None, python: str | None = None):
        self.target, self.port, self._env, self.python = target, port, env, server_python(python)
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def start(self, timeout_s: float = 60.0, wait: bool = True) -> "LocalServer":
        """Start the process and wait for /health (`wait`; else `healthy()` does, within `timeout_s` of now)."""
        # module:Class goes through the generic launcher (which skips openenv's gradio import).
        module = ["forge_rl.envs", self.target] if ":" in self.target else [self.target]
        argv = [self.python, "-m", *module, "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, **(self._env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPOSITORY), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        _RUNNING.add(self)
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        return self.healthy() if wait else self

    def healthy(self) -> "LocalServer":
        """Wait until the server answers /health; raises with its log if it dies or start's timeout passes."""
        while time.monotonic() < self.deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.target} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.target} not healthy on {self.url} after {self.timeout_s:g} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, timeout_s: float = 60.0) -> "LocalServer":
        """Stop and start again on the same port (sessions on the old process are lost)."""
        self.stop()
        return self.start(timeout_s)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-4000:]

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def launch_local(
    target: str,
    port: int | None = None,
    *,
    max_concurrent_envs: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    python: str | None = None,
    wait: bool = True,
) -> LocalServer:
    """Start `target` ('pkg.module:Class', or a module with a __main__) on 127.0.0.1; wait for /health (`wait`).
    `python`: the server's interpreter (see server_python)."""
    extra = dict(env or {})
    if max_concurrent_envs is not None:
        extra["MAX_CONCURRENT_ENVS"] = str(max_concurrent_envs)
    return LocalServer(target, port or free_port(), extra, python).start(timeout_s, wait)


def env_url(url: str | None = None, server: str | None = None, max_concurrent: int | None = None,
            python: str | None = None, env: dict[str, str] | None = None, wait: bool = True) -> tuple[str, LocalServer | None]:
    """A config's env section -> (URL to connect to, the server launched for it, with `env` added to its
    environment variables, or None). `wait=False`: the server's `healthy()` waits for it."""
    if (url is None) == (server is None):
        raise ValueError("env: set exactly one of url (a running server) or server (module:Class)")
    if url is not None:
        return url, None
    # generous: on a loaded machine importing openenv alone takes tens of seconds
    local = launch_local(server, max_concurrent_envs=max_concurrent, env=env, timeout_s=180, python=python, wait=wait)
    return local.url, local
