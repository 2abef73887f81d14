"""Generator: a real vLLM engine in a real Monarch actor, on the tiny model; weights through TorchStore.

The engine starts once for the module (tens of seconds on CPU). Reference log-probs come from
transformers' Qwen3 on the same files, an implementation independent of vLLM's.
"""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl import store
from forge_rl.actor import stop
from forge_rl.config import GeneratorConfig
from forge_rl.generator import Generator
from forge_rl.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def g(tmp_path_factory):
    """The running generator, the tiny model's files, its tokenizer and a reference model."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    loop = asyncio.new_event_loop()

    async def start():
        await store.start()
        config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
        return await Generator.options(procs=1).as_actor(str(path), "float32", config, seed=0)

    gen = loop.run_until_complete(start())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Your total is 15 (hard). The dealer shows 10. Answer with one word: HIT or STAND."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    try:
        yield SimpleNamespace(
            gen=gen,
            run=loop.run_until_complete,
            path=path,
            tokenizer=tokenizer,
            prompt=list(prompt),
            reference=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        )
    finally:
        loop.run_until_complete(stop(gen))
        loop.run_until_complete(store.stop())
        loop.close()


def generate(g, prompt, **sampling):
    return g.run(g.gen.generate.call_one(prompt, sampling))


def reference_logprobs(g, prompt, completion, temperature=1.0):
    """log softmax(logits / temperature) of each sampled token, and the argmax at each position."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = g.reference(ids).logits[0, len(prompt) - 1 : -1].float()  # position t predicts token t+1
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0], logits.argmax(-1)


def test_generate_returns_n_completions_with_aligned_ids_logprobs_text_and_version(g):
    version = g.run(g.gen.current_version.call_one())
    completions = generate(g, g.prompt, n=3, max_tokens=6, temperature=1.0, ignore_eos=True, seed=1)
    assert len(completions) == 3
    for c in completions:
        assert c.prompt_ids == g.prompt
        assert len(c.token_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.text == g.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.policy_version == version == 0
    assert len({tuple(c.token_ids) for c in completions}) > 1  # n independent samples, not one copied

    stopped = generate(g, g.prompt, max_tokens=200, temperature=1.0, stop_token_ids=list(range(len(g.tokenizer))))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1  # any token stops it


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_are_the_sampling_distributions_as_an_independent_model_computes_them(g, temperature):
    for c in generate(g, g.prompt, n=2, max_tokens=8, temperature=temperature, ignore_eos=True, seed=2):
        expected, _ = reference_logprobs(g, g.prompt, c, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_decoding_is_deterministic_and_takes_the_argmax(g):
    first = generate(g, g.prompt, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    again = generate(g, g.prompt, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    _, argmax = reference_logprobs(g, g.prompt, first)
    assert first.token_ids == argmax.tolist()


def test_choices_restrict_answers_and_logprobs_are_renormalised_over_them(g):
    completions = generate(g, g.prompt, n=24, max_tokens=4, temperature=1.0, seed=3, choices=["HIT", "STAND"])
    assert {c.text for c in completions} == {"HIT", "STAND"}
    assert all(c.finish_reason == "stop" for c in completions)
    # the answer word's log-probs are over the two allowed first tokens only: they sum to one
    first = {c.text: c.logprobs[0] for c in completions}
    assert math.exp(first["HIT"]) + math.exp(first["STAND"]) == pytest.approx(1.0, abs=1e-5)
    free = generate(g, g.prompt, n=24, max_tokens=4, temperature=1.0, seed=3)
    assert {c.text for c in free} - {"HIT", "STAND"}  # without the constraint the random model says anything


def test_concurrent_requests_are_all_served(g):
    async def many():
        prompts = [g.prompt[: len(g.prompt) - k] for k in range(6)]
        return await asyncio.gather(*(g.gen.generate.call_one(p, {"max_tokens": 5, "ignore_eos": True}) for p in prompts))

    results = g.run(many())
    assert [len(r[0].token_ids) for r in results] == [5] * 6


def test_a_groups_first_answers_come_from_one_request_each_used_once(g):
    """apps.blackjack.main.SharedFirstTurn on the real generator: the G games of a group share one
    request of n=G samples, each game gets a different one of them, and a game whose prompt differs asks alone."""
    from apps.blackjack.main import SharedFirstTurn

    requests = []  # [prompt, sampling, completions] of every request, in the order sent

    async def generate(prompt, sampling):
        requests.append([prompt, sampling, None])
        requests[-1][2] = completions = await g.gen.generate.call_one(prompt, sampling)
        return completions

    async def group():
        shared = SharedFirstTurn(generate, 6, {"max_tokens": 3, "temperature": 1.0, "ignore_eos": True})
        answers = await asyncio.gather(*(shared.answer(g.prompt) for _ in range(6)), shared.answer(g.prompt[:-1]))
        return answers, await shared.answer(g.prompt)  # a 7th game with the shared prompt: n are used up

    answers, seventh = g.run(group())
    assert sorted((len(p), s.get("n", 1)) for p, s, _ in requests) == [(len(g.prompt) - 1, 1), (len(g.prompt), 1), (len(g.prompt), 6)]
    (shared,) = [c for _, s, c in requests if s.get("n") == 6]
    assert [a.token_ids for a in answers[:6]] == [c.token_ids for c in shared]  # each sample once, in order
    assert len({tuple(a.token_ids) for a in answers[:6]}) > 1
    assert answers[6].prompt_ids == g.prompt[:-1] and seventh.prompt_ids == g.prompt


def test_weight_updates_change_logprobs_stamp_versions_and_restore_exactly(g):
    original = load_file(g.path / "model.safetensors")
    vocab_size = original["lm_head.weight"].shape[0]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = generate(g, g.prompt, **greedy)[0]

    async def update_while_generating(version):
        """A long request in flight while the update arrives: it finishes on the old weights (and says so)."""
        long = dict(max_tokens=64, ignore_eos=True, seed=5)
        in_flight = asyncio.ensure_future(g.gen.generate.call_one(g.prompt, long))
        await asyncio.sleep(0.05)
        await g.gen.update_weights.call_one(version)
        return await in_flight

    zeroed = dict(original, **{"lm_head.weight": torch.zeros_like(original["lm_head.weight"])})
    g.run(store.put_state_dict(zeroed, version=1))
    in_flight = g.run(update_while_generating(1))[0]
    uniform = -math.log(vocab_size)  # zero logits: every token equally likely
    after = generate(g, g.prompt, **greedy)[0]
    assert after.policy_version == 1 and g.run(g.gen.current_version.call_one()) == 1
    assert after.logprobs == pytest.approx([uniform] * 8, abs=1e-5)
    # the version stamped on the in-flight request is the truth about every one of its tokens
    print(f"in-flight request finished on version {in_flight.policy_version}")
    if in_flight.policy_version == 0:
        assert all(abs(lp - uniform) > 1e-4 for lp in in_flight.logprobs)
    else:
        assert in_flight.policy_version == 1 and in_flight.logprobs == pytest.approx([uniform] * 64, abs=1e-5)

    g.run(store.put_state_dict(original, version=2))
    g.run(g.gen.update_weights.call_one(2))
    restored = generate(g, g.prompt, **greedy)[0]
    assert restored.policy_version == 2
    assert restored.token_ids == before.token_ids and restored.logprobs == before.logprobs  # bit-exact

    with pytest.raises(Exception, match="policy/v99"):
        g.run(g.gen.update_weights.call_one(99))
    assert g.run(g.gen.current_version.call_one()) == 2
    for version in (1, 2):
        g.run(store.delete_version(version))
