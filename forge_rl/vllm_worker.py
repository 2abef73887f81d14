"""vLLM worker extension: the generator's half of weight sync, run inside vLLM's worker process.

vLLM imports this class by qualified name (`worker_extension_cls="forge_rl.vllm_worker.WeightSyncExtension"`)
and mixes it into its worker, so `AsyncLLM.collective_rpc("load_weights_file", args=(path,))` runs
`load_weights_file` on every worker (every tensor-parallel rank; each loads its own shards).

Why a file path, not tensors: `collective_rpc` arguments cross to the engine process through msgpack,
which turns tensors into nested lists. The Generator writes the state dict once to a safetensors file
(in /dev/shm when it fits, so it stays in memory) and every worker memory-maps it.

The faster transports (forge_rl/weight_sync.py) pass a small WeightsHandle dict instead: `load_shared_weights`
reads views of a shared-memory buffer this worker maps once; `receive_weights` takes a broadcast from the
trainer into a staging buffer the worker keeps, then `load_staged_weights` reads views of it.

Why `reload_weights(is_checkpoint_format=True)`: vLLM repacks some weights after loading (on CPU, for
its matmul kernels), so loading HF-format tensors straight into the parameters breaks; vLLM's in-place
reload re-runs that processing after the copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from forge_rl import weight_sync
from forge_rl.weight_sync import WeightsHandle


class WeightSyncExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`)."""

    def load_weights_file(self, path: str) -> int:
        """Every worker, blocking the engine: load HF-named weights from the safetensors file at `path`.

        Returns the number of tensors read. The caller must keep requests off the engine meanwhile
        and reset the prefix cache after (cached KV blocks were computed with the old weights).
        """
        loaded = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    loaded += 1
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return loaded

    def load_shared_weights(self, handle: dict) -> int:
        """Every worker, blocking the engine: load the version in the shared-memory buffer `handle` names.

        Raises StaleWeightsError if the buffer does not hold that version before the load, or no longer
        after it (then the engine's weights are a mix: the caller must not serve them as any version).
        """
        handle = WeightsHandle(**handle)
        loaded = self._load(weight_sync.shared_views(handle))
        weight_sync.check_buffer(weight_sync.map_buffer(handle.path), handle)
        return loaded

    def join_weights_group(self, rendezvous: str, port: int, first_rank: int, world: int, bind: str) -> int:
        """Every worker: join the trainer's broadcast group as rank `first_rank` + this worker's rank."""
        rank = first_rank + self.rank
        self.weights_group = weight_sync.join_group(rendezvous, port, rank, world, bind)
        self.weights_staging = None
        return rank

    def receive_weights(self, handle: dict) -> int:
        """Every worker, blocking the engine: take the trainer's broadcast of one version into staging."""
        handle = WeightsHandle(**handle)
        if getattr(self, "weights_group", None) is None:
            raise RuntimeError("this vLLM worker never joined the weights broadcast group (a restarted replica?); "
                               "set generator.weight_sync to shm or store, or rebuild the group")
        self.weights_staging = weight_sync.broadcast_receive(self.weights_group, handle, self.weights_staging)
        self.weights_staged_version = handle.version
        return handle.nbytes

    def load_staged_weights(self, handle: dict) -> int:
        """Every worker, blocking the engine: load the version `receive_weights` staged."""
        handle = WeightsHandle(**handle)
        if getattr(self, "weights_staged_version", None) != handle.version:
            raise weight_sync.StaleWeightsError(f"version {handle.version} was not received by broadcast")
        return self._load(weight_sync.tensor_views(self.weights_staging, handle.layout))

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        loaded = 0

        def counted():
            nonlocal loaded
            for item in weights:
                loaded += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return loaded
