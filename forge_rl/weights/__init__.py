"""Weight sync: how one policy version's bytes go from the trainer to the generators' vLLM workers.

    Trainer.push_weights(v) --Publisher.publish--> shared memory | broadcast | TorchStore
                            --WeightsHandle-->     TorchStore `policy/v{v}/handle`      (control.py)
    Generator.update_weights(v) --stage(v)-->      the vLLM worker method that loads it (engines/vllm/worker.py)

One file per transport, holding both of its sides: shm.py (one host), broadcast.py (across hosts),
store.py (the fallback: the state dict itself in TorchStore). layout.py is the packing they share,
control.py the versioned record, plan.py the choice of a transport, made once at set-up. A new transport
is one more file with a Publisher and a `stage`, and one line in `transport`.
"""

from __future__ import annotations


class Publisher:
    """The trainer's side of a transport; one per trainer rank, made once at set-up (collective).

    `publish` runs on every rank with HF-named meta shapes (in layout order) and an iterator over the tensors,
    and returns once a generator can fetch the version. `adapter` ({"scale": ...}): the tensors are LoRA
    adapters. With `every_rank_writes`, `rows=True` iterators give (first row, own rows) (hf_weights.py
    `hf_weight_rows`). A transport that sends to each replica (broadcast) returns those in `receivers` it sent to.
    """

    every_rank_writes = False

    async def publish(self, shapes: dict, tensors, version: int, rows: bool = False, adapter: dict | None = None,
                      receivers: list[int] | None = None) -> list[int] | None:
        raise NotImplementedError

    async def sent(self) -> None:
        """Wait until the last publication no longer reads the trainer's parameters (before they change)."""

    def join(self, rendezvous: str, port: int, world: int, bind: str, replica: int = 0) -> None:
        raise ValueError(f"{type(self).__name__}: only the broadcast transport joins a process group")

    def resend(self, replica: int, tensors, version: int) -> None:
        raise ValueError(f"{type(self).__name__}: only the broadcast transport sends to one replica")

    def close(self) -> None:
        """Release what the publisher holds (shared-memory buffers)."""


def transport(kind: str):
    """The module of a transport: its Publisher class and its generator-side `stage`."""
    from forge_rl.weights import broadcast, shm, store

    modules = {"shm": shm, "broadcast": broadcast, "store": store}
    if kind not in modules:
        raise ValueError(f"weight sync: unknown transport {kind!r}; known: {', '.join(modules)}")
    return modules[kind]


def make_publisher(kind: str, rank: int, world: int, device) -> Publisher:
    """The trainer's publisher for the planned transport (collective on every rank)."""
    return transport(kind).Publisher(rank, world, device)


async def stage(version: int, engine, prefix: str = "policy") -> tuple[str, tuple, object]:
    """Generator side: (vLLM worker method that loads `version`, its arguments, a file to delete after or None)."""
    from forge_rl.weights import control

    handle = await control.get_handle(version, prefix=prefix)
    kind = "store" if handle is None else handle["kind"]
    return await transport(kind).stage(version, handle, engine, prefix)
