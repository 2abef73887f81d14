"""vLLM worker extension: the generator's half of weight sync, run inside vLLM's worker process.

vLLM imports this class by qualified name (`worker_extension_cls="forge_rl.vllm_worker.WeightSyncExtension"`)
and mixes it into its worker, so `AsyncLLM.collective_rpc("load_weights_file", args=(path,))` runs
`load_weights_file` on every worker (every tensor-parallel rank; each loads its own shards).

Why a file path, not tensors: `collective_rpc` arguments cross to the engine process through msgpack,
which turns tensors into nested lists. The Generator writes the state dict once to a safetensors file
(in /dev/shm when it fits, so it stays in memory) and every worker memory-maps it.

Why `reload_weights(is_checkpoint_format=True)`: vLLM repacks some weights after loading (on CPU, for
its matmul kernels), so loading HF-format tensors straight into the parameters breaks; vLLM's in-place
reload re-runs that processing after the copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open


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
