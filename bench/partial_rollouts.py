"""Partial rollouts on against off, in the same run: how long a weight update takes to land under a
workload of long generations, and how many episodes per second the engine serves meanwhile.

Two Generators serve the tiny model, one with `generator.partial_rollouts: true` (a weight update
pauses the running requests, swaps, resumes them) and one with false (it waits for them to finish,
WeightGate). Rounds alternate between them so both see the same machine load; in a round, `--streams`
callers each send long requests (`--tokens` sampled tokens, EOS ignored) back to back while, every
`--interval` seconds, new weights are pushed to TorchStore and the generator updated. Update latency:
from the start of the push until `update_weights` returns (the generator serves v+1). Episodes/s:
requests finished in the round over its length. Figures only, no asserts.

    python bench/partial_rollouts.py [--rounds 2 --streams 4 --tokens 256 --interval 4 --updates 3]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl.weights import control  # noqa: E402
from forge_rl.runtime.actor import stop  # noqa: E402
from forge_rl.core.config import GeneratorConfig  # noqa: E402
from forge_rl.engines.vllm.generator import Generator  # noqa: E402
from forge_rl.models.tiny import build_tiny_model  # noqa: E402


async def one_round(args, generator, weights, first_version: int) -> tuple[list[float], float]:
    """(update latencies in seconds, episodes per second) of one round on `generator`."""
    prompt = list(range(10, 30))
    sampling = dict(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    finished, stopping = [], asyncio.Event()

    async def stream():
        while not stopping.is_set():
            await generator.generate.call_one(prompt, sampling)
            finished.append(time.perf_counter())

    start = time.perf_counter()
    streams = [asyncio.ensure_future(stream()) for _ in range(args.streams)]
    latencies = []
    for i in range(args.updates):
        await asyncio.sleep(args.interval)
        version = first_version + i
        clock = time.perf_counter()
        await control.put_state_dict(weights[version % 2], version)
        await generator.update_weights.call_one(version)
        latencies.append(time.perf_counter() - clock)
        if version > 1:
            await control.delete_version(version - 1)
    end = time.perf_counter()
    stopping.set()
    await asyncio.gather(*streams)
    return latencies, sum(start <= t <= end for t in finished) / (end - start)


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = [build_tiny_model(Path(tmp) / f"v{s}", seed=s) for s in (0, 1)]
        weights = [load_file(str(p / "model.safetensors")) for p in paths]
        await control.start()
        generators = {}
        try:
            for mode in ("on", "off"):
                config = GeneratorConfig(max_model_len=512, gpu_memory_utilization=0.02, partial_rollouts=mode == "on")
                generators[mode] = await Generator.options(procs=1).as_actor(str(paths[0]), "float32", config)
            results = {"on": ([], []), "off": ([], [])}
            version = 1
            for r in range(args.rounds + 1):  # round 0 warms both engines up
                for mode in ("on", "off"):
                    latencies, eps = await one_round(args, generators[mode], weights, version)
                    version += args.updates
                    if r:
                        results[mode][0].extend(latencies)
                        results[mode][1].append(eps)
                    print(f"round {r} {mode:3s}: update latency s {[round(x, 2) for x in latencies]}, episodes/s {eps:.2f}")
        finally:
            for generator in generators.values():
                await stop(generator)
            await control.stop()

    latency = {m: statistics.median(results[m][0]) for m in results}
    eps = {m: statistics.mean(results[m][1]) for m in results}
    print(f"workload: {args.streams} streams of {args.tokens}-token requests, an update every {args.interval} s, "
          f"{args.rounds} rounds x {args.updates} updates per mode (medians of latency, means of episodes/s)")
    print(f"partial_rollouts update_latency_s on={latency['on']:.3f} off={latency['off']:.3f}")
    print(f"partial_rollouts episodes_per_s on={eps['on']:.2f} off={eps['off']:.2f} ratio={eps['on'] / eps['off']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4, help="concurrent callers")
    parser.add_argument("--tokens", type=int, default=256, help="sampled tokens per request")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between weight updates")
    parser.add_argument("--updates", type=int, default=3, help="weight updates per round")
    asyncio.run(main(parser.parse_args()))
