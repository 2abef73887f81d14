"""The chat-agent form's invariant, end to end under partial rollouts: every token a tool-calling agent's
policy sampled reaches the trainer with the log-prob it was sampled with and the version of the weights that
sampled it, unchanged, through the chat server (HTTP, the OpenAI SDK), its record, the Episode and the
trainer's batch. Weight updates land between the agent's turns and in the middle of one of its requests.

The policy is the scripted tiny model (tests/chat_helpers.py): its first reply is a tool call with p ~0.4;
any other reply is random words until max_tokens (long enough for an update to pause it part-way).
"""

import asyncio
import pickle
import time

import httpx
import pytest
import torch
from openai import AsyncOpenAI
from safetensors.torch import load_file
from transformers import AutoTokenizer

from forge_rl.core.config import ChatConfig, GeneratorConfig, GRPOConfig
from forge_rl.core.objective import GRPOLoss
from forge_rl.engines.titan.trainer import Trainer
from forge_rl.engines.vllm.generator import Generator
from forge_rl.rollout.chat_server import ChatServer
from forge_rl.weights import control
from forge_rl.weights.layout import WeightsHandle
from tests.steps import train_step
from tests.chat_helpers import RUN_PYTHON, build_scripted_model, sampled_runs

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]
LONG = 300  # tokens of a reply that is not a tool call


def test_every_sampled_token_reaches_the_trainer_with_its_logprob_and_version(tmp_path):
    path = build_scripted_model(tmp_path / "model")
    tokenizer, weights = AutoTokenizer.from_pretrained(path), load_file(path / "model.safetensors")
    recorded = {}  # rollout id -> every Completion the policy service returned for it, as it returned it

    async def main():
        await control.start()
        config = GeneratorConfig(max_model_len=1024, gpu_memory_utilization=0.01, partial_rollouts=True)
        policy = await Generator.options().as_service(str(path), "float32", config, 0)
        versions = iter(range(1, 100))

        async def push() -> int:  # the trainer's weights (the same bytes: only the version stamps differ)
            version = next(versions)
            await control.put_state_dict(weights, version)
            await control.put_handle(WeightsHandle("store", version).as_dict(), version)
            await policy.fanout("update_weights", version)
            return version

        async def generate(prompt_ids, params, session):
            completions = await policy.route("generate", prompt_ids, params, session=session)
            recorded.setdefault(session, []).extend(completions)
            return completions

        sampling = {"temperature": 1.0, "max_tokens": LONG, "top_p": 1.0}
        server = ChatServer(tokenizer, generate, sampling, dict(sampling, temperature=0.0), ChatConfig(tool_parser="hermes"), 1024)
        await server.start()
        try:
            clock = time.perf_counter()
            await policy.route("generate", [3, 40, 41], dict(sampling, ignore_eos=True))
            duration = time.perf_counter() - clock  # of a long reply, engine warm
            for _ in range(30):
                result = await agent(server, push, duration)
                if result is not None:
                    return result
            raise AssertionError("no rollout had a tool call first and a reply paused part-way by an update")
        finally:
            await server.stop()
            await policy.stop()
            await control.stop()

    trajectory, episodes, last_version = asyncio.run(main())
    recorded = recorded[trajectory["rollout_id"]]

    # The record: each reply's tokens with their log-probs and versions exactly as the policy returned them.
    replies = 0
    for segment in trajectory["segments"]:
        runs = sampled_runs(segment)
        starts = [i for i, s in enumerate(segment["sampled"]) if s and (i == 0 or not segment["sampled"][i - 1])]
        for start, run in zip(starts, runs):
            (completion,) = [c for c in recorded if c.prompt_ids == segment["token_ids"][:start] and c.token_ids == run]
            assert segment["logprobs"][start : start + len(run)] == completion.logprobs
            assert segment["versions"][start : start + len(run)] == completion.token_versions
            replies += 1
    assert replies == 3
    versions = {v for s in trajectory["segments"] for v in s["versions"] if v is not None}
    assert len(versions) == 3, f"turns at three versions, one reply straddling two: {versions}"

    # The Episodes, through pickling as Monarch sends them, and the trainer's batch: the same numbers.
    episodes = [pickle.loads(pickle.dumps(e)) for e in episodes]
    for episode, segment in zip(episodes, trajectory["segments"]):
        sampled = torch.tensor(segment["sampled"])
        assert torch.equal(episode.loss_mask, sampled) and episode.tokens.tolist() == segment["token_ids"]
        assert torch.equal(episode.behaviour_logprobs, torch.tensor(segment["logprobs"], dtype=torch.float32))
        assert episode.token_versions.tolist() == [v if v is not None else -1 for v in segment["versions"]]
    trainer = Trainer(str(path), GRPOLoss(GRPOConfig(max_policy_age=3, entropy_coef=0.0, loss_agg="token_mean")), micro_batch_size=1)
    asyncio.run(Trainer.setup._method(trainer))
    trainer.policy_version = last_version
    t = trainer._tensors(episodes, None)
    for i, e in enumerate(episodes):
        n, mask = len(e.tokens), e.loss_mask.bool()
        assert torch.equal(t["behaviour"][i, :n], e.behaviour_logprobs)
        assert torch.equal(t["ages"][i, :n][mask], last_version - e.token_versions[mask])
    # ... and the trainer, at the same weights, scores what was sampled as the policy did: ratio 1 at every age
    metrics = train_step(trainer, episodes, None)
    ages = {k: v for k, v in metrics.items() if k.startswith("ratio_")}
    assert metrics["ratio_min"] == pytest.approx(1, abs=1e-3) and metrics["ratio_max"] == pytest.approx(1, abs=1e-3), ages


async def agent(server, push, duration):
    """One agent: a tool call first (else None), the tool's result, a long reply with an update pushed while
    it is sampled, another turn. Returns (trajectory, episodes, last version) when the long reply holds two
    versions, else None (it finished before the update, or was not long)."""
    rollout = server.open_rollout()
    async with AsyncOpenAI(base_url=f"{server.url}/s/{rollout.rollout_id}/v1", api_key="any") as client:

        async def ask(messages):
            return (await client.chat.completions.create(model="policy", messages=messages, tools=[RUN_PYTHON])).choices[0].message

        messages = [{"role": "user", "content": "what is six times seven"}]
        first = await ask(messages)
        if not first.tool_calls:
            await server.end_rollout(rollout.rollout_id, 0.0)
            return None
        await push()  # between the turns
        messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "42"}]
        long = asyncio.ensure_future(ask(messages))
        await asyncio.sleep(duration / 3)
        version = await push()  # while the long reply is sampled
        second = await long
        messages += [second.model_dump(exclude_none=True), {"role": "user", "content": "and now"}]
        await ask(messages)
        async with httpx.AsyncClient() as http:
            trajectory = (await http.get(f"{server.url}/s/{rollout.rollout_id}/trajectory")).json()
    ended = await server.end_rollout(rollout.rollout_id, 1.0)
    mixed = any(len({v for v, s in zip(seg["versions"], seg["sampled"]) if s}) > 2 for seg in trajectory["segments"])
    if not mixed or len({v for s in trajectory["segments"] for v in s["versions"] if v is not None}) != 3:
        return None
    return trajectory, ended.episodes("group"), version
