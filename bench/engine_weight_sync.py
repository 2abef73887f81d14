"""Weight sync through TorchStore vs a plain in-memory copy of the same state dict, in the same run.

Baseline: `{k: v.clone()}` of the state dict in this process: moving the bytes once, with no
transport. Measured: the controller puts the state dict in TorchStore under a version (what
Trainer.push_weights does on rank 0), then an actor in its own process gets it (what
Generator.update_weights does first); put is timed here, get inside the reader, end-to-end from the
start of the put to the reader's answer. The version is deleted after each round, as the training
loop drops old ones. Rounds alternate baseline and store, so both see the same machine load. The
state dict is the tiny model's Qwen3 layout (HF names, fp32) at `--hidden`/`--layers`, built in
memory. The ratio is what the transport costs against copying the bytes.

Then, unless `--no-update`: `Generator.update_weights` end to end (store fetch, safetensors file,
vLLM reload) on a small model a Generator actor serves. Figures only, no asserts; MB = 10^6 bytes.

    python bench/engine_weight_sync.py [--hidden 1024 --layers 3 --rounds 5 --update-hidden 128 --no-update]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from monarch.actor import endpoint
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl import store  # noqa: E402
from forge_rl.actor import ForgeActor, stop  # noqa: E402
from forge_rl.config import GeneratorConfig  # noqa: E402
from forge_rl.generator import Generator  # noqa: E402
from forge_rl.tiny_model import build_tiny_model, build_tokenizer, model_config, random_weights  # noqa: E402


def megabytes(state_dict: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in state_dict.values()) / 1e6


class WeightsReader(ForgeActor):
    """Gets a version from TorchStore in its own process, as a generator does."""

    @endpoint
    async def fetch(self, version: int) -> tuple[float, float]:
        """Controller, blocking: (seconds the get took, MB received); the tensors stay here."""
        start = time.perf_counter()
        state_dict = await store.get_state_dict(version)
        return time.perf_counter() - start, megabytes(state_dict)


async def store_rounds(args, state_dict) -> dict[str, list[float]]:
    """Seconds per round for the in-memory copy and for put, get and put-to-get-done through TorchStore."""
    reader = await WeightsReader.options(procs=1).as_actor()
    times = {"copy": [], "put": [], "get": [], "end_to_end": []}
    try:
        for version in range(1, 2 + args.rounds):  # version 1 is the warm-up
            start = time.perf_counter()
            copy = {k: v.clone() for k, v in state_dict.items()}
            copied = time.perf_counter() - start
            del copy
            start = time.perf_counter()
            await store.put_state_dict(state_dict, version)
            put = time.perf_counter() - start
            get, _ = await reader.fetch.call_one(version)
            end_to_end = time.perf_counter() - start
            await store.delete_version(version)
            if version > 1:
                for name, seconds in zip(times, (copied, put, get, end_to_end)):
                    times[name].append(seconds)
    finally:
        await stop(reader)
    return times


async def update_rounds(args, model_dir: Path) -> list[float]:
    """Seconds per Generator.update_weights (store fetch + file + vLLM load), weights already in the store."""
    generator = await Generator.options(procs=1).as_actor(str(model_dir), "float32", GeneratorConfig(max_model_len=256))
    weights = load_file(str(model_dir / "model.safetensors"))
    times = []
    try:
        for version in range(1, 2 + args.rounds):
            await store.put_state_dict(weights, version)
            start = time.perf_counter()
            await generator.update_weights.call_one(version)
            times.append(time.perf_counter() - start)
            await store.delete_version(version)
    finally:
        await stop(generator)
    return times[1:]


def report(label: str, mb: float, seconds: list[float]) -> float:
    """Print the median rate and each round's; return the median MB/s."""
    rate = mb / statistics.median(seconds)
    rounds = ", ".join(f"{mb / s:.0f}" for s in seconds)
    print(f"{label:36s} {rate:8.0f} MB/s  {statistics.median(seconds) * 1e3:8.1f} ms   rounds MB/s: {rounds}")
    return rate


async def main(args) -> None:
    config = model_config(build_tokenizer().get_vocab_size(), args.hidden, args.layers, 2048)
    state_dict = random_weights(config, seed=0, std=0.02)
    mb = megabytes(state_dict)
    await store.start()
    try:
        times = await store_rounds(args, state_dict)
        if not args.no_update:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = build_tiny_model(Path(tmp) / "tiny", hidden_size=args.update_hidden)
                update_mb = megabytes(load_file(str(model_dir / "model.safetensors")))
                update_times = await update_rounds(args, model_dir)
    finally:
        await store.stop()

    print(f"state dict: Qwen3 layout, hidden {args.hidden}, {args.layers} layers, fp32: {len(state_dict)} tensors, "
          f"{mb:.1f} MB; {args.rounds} rounds after 1 warm-up, medians")
    copy = report("baseline: {k: v.clone()} in-process", mb, times["copy"])
    report("TorchStore put (controller)", mb, times["put"])
    report("TorchStore get (another process)", mb, times["get"])
    end_to_end = report("TorchStore put + get, end to end", mb, times["end_to_end"])
    print(f"TorchStore end to end / in-memory copy: {end_to_end / copy:.3f}")
    if not args.no_update:
        print(f"Generator.update_weights, tiny model hidden {args.update_hidden}, 2 layers ({update_mb:.1f} MB):")
        report("  store fetch + file + vLLM load", update_mb, update_times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="multiple of 64")
    parser.add_argument("--layers", type=int, default=3, help="with --hidden 1024: 3 layers are ~120 MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--update-hidden", type=int, default=128, help="the Generator's tiny model (2 layers)")
    parser.add_argument("--no-update", action="store_true", help="skip the Generator.update_weights timing")
    asyncio.run(main(parser.parse_args()))
