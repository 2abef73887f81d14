"""Partial rollouts end to end: a real vLLM engine pauses a long request for a weight update and
resumes it; every token carries the version that sampled it; a real Trainer at the new version
scores the episode, and the geometric IS mask tells a mixed-version episode from a pure one.

Models: the tiny model (v0) and another tiny model far from it (v1: other seed, larger weights).
Reference log-probs come from transformers' Qwen3, independent of vLLM.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl.weights import control, shm
from forge_rl.weights.layout import fused_order
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GeneratorConfig
from forge_rl.engines.vllm.generator import Generator
from forge_rl.core.loss import is_weights
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.trainer import Trainer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
LONG = dict(temperature=1.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def p(tmp_path_factory):
    v0 = build_tiny_model(tmp_path_factory.mktemp("v0"), seed=0)
    v1 = build_tiny_model(tmp_path_factory.mktemp("v1"), seed=1, init_std=0.1)
    loop = asyncio.new_event_loop()

    async def start():
        await control.start()
        config = GeneratorConfig(max_model_len=512, gpu_memory_utilization=0.01, partial_rollouts=True)
        return await asyncio.gather(
            Generator.options(procs=1).as_actor(str(v0), "float32", config, seed=0),
            Trainer.options(procs=1).as_actor(str(v1)),  # the trainer at v1
        )

    gen, trainer = loop.run_until_complete(start())
    tokenizer = AutoTokenizer.from_pretrained(v0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Dealer 10. You 17 soft. HIT or STAND?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    try:
        yield SimpleNamespace(
            gen=gen, trainer=trainer, run=loop.run_until_complete, prompt=list(prompt), v1_weights=load_file(v1 / "model.safetensors"),
            models=[AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in (v0, v1)],
        )
    finally:
        loop.run_until_complete(stop(gen))
        loop.run_until_complete(stop(trainer))
        loop.run_until_complete(control.stop())
        loop.close()


def logprobs_under(model, prompt, token_ids):
    """Each sampled token's log-prob under `model` given the full prefix (temperature 1)."""
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_a_request_straddling_a_weight_update_is_paused_not_aborted_and_tagged_per_token(p):
    """Three streams of long requests, staggered, keep requests in flight at every moment, so the
    update pauses some of them part-way whatever this machine's speed (timing one request alone is
    not reliable on shared cores)."""
    (warm,) = p.run(p.gen.generate.call_one(p.prompt, LONG))
    assert warm.token_versions == [0] * 200
    clock = time.perf_counter()
    p.run(p.gen.generate.call_one(p.prompt, LONG))
    duration = time.perf_counter() - clock  # of 200 tokens, engine warm
    p.run(control.put_state_dict(p.v1_weights, version=1))

    async def straddle():
        done, updated = [], asyncio.Event()

        async def stream(i):
            await asyncio.sleep(i * duration / 3)
            while not updated.is_set():
                (c,) = await p.gen.generate.call_one(p.prompt, dict(LONG, seed=100 * i + len(done)))
                done.append((c, updated.is_set()))  # (completion, did update_weights return before it)

        streams = [asyncio.ensure_future(stream(i)) for i in range(3)]
        await asyncio.sleep(2 * duration)
        await p.gen.update_weights.call_one(1)
        updated.set()
        await asyncio.gather(*streams)
        return done

    done = p.run(straddle())
    mixed = [(c, after) for c, after in done if len(set(c.token_versions)) > 1]
    print(f"200 tokens take {duration:.2f} s; sampled at v0 per request: {[c.token_versions.count(0) for c, _ in done]}")
    assert mixed, "no request was in flight during the update"
    c, update_returned_first = max(mixed, key=lambda m: m[0].token_versions.count(1))
    assert update_returned_first  # update_weights returned before the request did
    for m, _ in done:  # nothing aborted or restarted from zero
        assert m.finish_reason == "length" and len(m.token_ids) == 200
    k = c.token_versions.count(0)
    assert 0 < k < 200 and c.token_versions == [0] * k + [1] * (200 - k)
    assert c.policy_version == 0  # the oldest token's
    behaviour = torch.tensor(c.logprobs)
    v0, v1 = (logprobs_under(m, p.prompt, c.token_ids) for m in p.models)
    torch.testing.assert_close(behaviour[:k], v0[:k], atol=2e-4, rtol=0)
    torch.testing.assert_close(behaviour[k:], v1[k:], atol=2e-4, rtol=0)  # over the full prefix: cache cleared
    assert (v0[k:] - v1[k:]).abs().mean() > 0.1  # the two models are far apart

    # A request after the update is all v1.
    (pure,) = p.run(p.gen.generate.call_one(p.prompt, dict(LONG, seed=8)))
    assert pure.token_versions == [1] * 200 and pure.policy_version == 1

    # The trainer at v1: log-ratio ~0 on the v1 tokens, clearly not on the v0 tokens.
    episodes = [torch.tensor(p.prompt + x.token_ids) for x in (c, pure)]
    trained = p.run(p.trainer.logprobs.call_one(episodes))
    start = len(p.prompt)
    log_ratio = trained[0][start:] - behaviour
    assert log_ratio[k:].abs().max() < 1e-3
    assert log_ratio[:k].abs().mean() > 0.1
    pure_log_ratio = trained[1][start:] - torch.tensor(pure.logprobs)
    assert pure_log_ratio.abs().max() < 1e-3

    # The geometric mask with a tight band removes the mixed episode and keeps the pure one.
    weights = is_weights(torch.stack([log_ratio, pure_log_ratio]), torch.ones(2, 200), "geo", "mask", 0.99, 1.01)
    assert weights[0].sum() == 0 and weights[1].sum() == 200
    p.run(control.delete_version(1))


def test_after_a_load_that_failed_midway_tokens_are_stamped_minus_1_until_an_update_succeeds(p):
    """A version in shared memory whose final norm has the wrong shape: the engine loads the embeddings and
    the layers' norms, then fails, so its weights are of no version (and it serves on). With partial rollouts
    a token's version is vLLM's own stamp, which must say so too (-1), not the version before the failed
    load; the next good update stamps its version."""
    buffers = shm.SharedBuffers()

    def publish(state_dict, version):
        handle = buffers.write(state_dict, version)
        p.run(control.put_handle(handle.as_dict(), version))
        return p.run(p.gen.update_weights.call_one(version))

    def versions():
        return p.run(p.gen.generate.call_one(p.prompt, dict(LONG, max_tokens=4)))[0].token_versions

    try:
        good = fused_order(dict(p.v1_weights))  # as a trainer publishes: each linear layer one block
        publish(good, 2)
        assert versions() == [2] * 4
        broken = dict(good, **{"model.norm.weight": torch.ones(good["model.norm.weight"].numel() + 1)})
        assert list(broken)[-1] == "model.norm.weight"  # loaded last: everything before it is in
        with pytest.raises(Exception, match="Attempted to load weight"):
            publish(broken, 3)
        assert versions() == [-1] * 4 and p.run(p.gen.current_version.call_one()) == -1
        publish(good, 4)
        assert versions() == [4] * 4
    finally:
        p.run(p.gen.finish_loading.call_one())
        buffers.close()
        for version in (2, 3, 4):
            p.run(control.delete_version(version))
