"""Requests per second through the chat server against direct `generate` calls, in the same run.

Baseline: the policy service's `generate` called with token ids, as the environment form's turns do.
Measured: the same requests as chat completions through the ChatServer (forge_rl/rollout/chat_server.py) on
this event loop, as a chat-agent run sends them: each request a new rollout's first turn, rendered
with the chat template, recorded, answered in OpenAI's JSON. Three clients: plain httpx on one
connection pool (the server's own cost); `AsyncOpenAI` on a shared aiohttp pool (`http_client=`, what
apps/blackjack/agent.py does with ctx.http_client); a fresh `AsyncOpenAI` per request (its own SSL
context and connection, what an agent written `async with AsyncOpenAI(...)` pays per run). Rounds
alternate between them so all see the same machine load. Figures only, no asserts.

    python bench/chat_server.py [--requests 64 --concurrency 16 --max-tokens 4 --rounds 3]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from openai import AsyncOpenAI, DefaultAioHttpClient  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from forge_rl.rollout.chat_server import ChatServer  # noqa: E402
from forge_rl.core.config import ChatConfig, GeneratorConfig  # noqa: E402
from forge_rl.engines.vllm.generator import Generator  # noqa: E402
from forge_rl.models.tiny import build_tiny_model  # noqa: E402

QUESTION = "Dealer {}. You {} hard. HIT or STAND?"


async def bounded(concurrency: int, calls) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(call):
        async with gate:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


async def main(args) -> None:
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
    policy = await Generator.options(procs=1).as_service(str(model_dir), "float32", config, 0)
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}

    async def generate(prompt_ids, params, session):
        return await policy.route("generate", prompt_ids, params, session=session)

    server = ChatServer(tokenizer, generate, sampling, {**sampling, "temperature": 0.0}, ChatConfig(), config.max_model_len)
    url = await server.start()
    questions = [QUESTION.format(2 + i % 9, 4 + i % 17) for i in range(args.requests)]
    http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency))
    pool = DefaultAioHttpClient()  # as forge_rl/rollout/agents.py gives agents in ctx.http_client

    async def direct(question):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False)
        await policy.route("generate", list(ids), sampling)

    async def shared_client(question):
        rollout = server.open_rollout()
        body = {"model": "policy", "messages": [{"role": "user", "content": question}]}
        response = await http.post(f"{url}/s/{rollout.rollout_id}/v1/chat/completions", json=body)
        response.raise_for_status()
        await server.end_rollout(rollout.rollout_id, 0.0)

    async def sdk_shared_pool(question):
        rollout = server.open_rollout()
        client = AsyncOpenAI(base_url=f"{url}/s/{rollout.rollout_id}/v1", api_key="any", http_client=pool)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        await server.end_rollout(rollout.rollout_id, 0.0)

    async def sdk_per_request(question):
        rollout = server.open_rollout()
        async with AsyncOpenAI(base_url=f"{url}/s/{rollout.rollout_id}/v1", api_key="any") as client:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        await server.end_rollout(rollout.rollout_id, 0.0)

    kinds = {
        "direct generate": direct,
        "chat server, httpx on one pool": shared_client,
        "chat server, AsyncOpenAI on one pool": sdk_shared_pool,
        "chat server, AsyncOpenAI per request": sdk_per_request,
    }
    rates = {k: [] for k in kinds}
    await bounded(args.concurrency, [lambda q=q: direct(q) for q in questions[:8]])  # warm-up
    for _ in range(args.rounds):
        for name, kind in kinds.items():
            start = time.perf_counter()
            await bounded(args.concurrency, [lambda q=q, kind=kind: kind(q) for q in questions])
            rates[name].append(args.requests / (time.perf_counter() - start))
    await http.aclose()
    await pool.aclose()
    await server.stop()
    await policy.stop()

    base = statistics.median(rates["direct generate"])
    print(f"{args.requests} requests per round, {args.concurrency} concurrent, {args.max_tokens} tokens each, {args.rounds} rounds (median):")
    for name, values in rates.items():
        print(f"  {name:40s} {statistics.median(values):7.1f} requests/s   ratio {statistics.median(values) / base:.2f}")
    for name in ("chat server, AsyncOpenAI on one pool", "chat server, AsyncOpenAI per request"):
        overhead = 1 / statistics.median(rates[name]) - 1 / base
        print(f"  {name.removeprefix('chat server, ')} adds {1000 * overhead:.1f} ms per request at this concurrency")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
