"""SharedRequests and GreedyAnswers alone, on CPU: which requests they send and which sample each game gets.

`generate` here is a plain function that records its calls and numbers its samples, so the sharing
logic is checked without an engine (tests/test_generator.py checks it on the real Generator).
"""

import asyncio

from forge_rl.rollout.requests import GreedyAnswers, SharedRequests
from forge_rl.core.types import Completion


def recording_generate(answer_of):
    """A generate(prompt ids, sampling) that answers sample i of a request with answer_of(i) and logs calls."""
    calls = []

    async def generate(prompt_ids, sampling):
        n = sampling.get("n", 1)
        calls.append((tuple(prompt_ids), n))
        await asyncio.sleep(0)
        return [
            Completion(prompt_ids=list(prompt_ids), token_ids=[answer_of(i)], logprobs=[-0.5], text=str(i),
                       finish_reason="length", policy_version=0)
            for i in range(n)
        ]

    return generate, calls


def test_a_group_shares_one_request_per_prompt_and_each_sample_goes_to_one_game():
    generate, calls = recording_generate(lambda i: 10 + i % 2)  # samples 0, 2 answer 10; 1, 3 answer 11
    shared = SharedRequests(generate, 4, {"temperature": 1.0})

    async def group():
        firsts = await asyncio.gather(*(shared.answer([1, 2]) for _ in range(4)))
        # each game moves on to the prompt its answer leads to; games that answered alike share it
        seconds = await asyncio.gather(*(
            shared.answer([1, 2, c.token_ids[0], 3 + c.token_ids[0]], ((1, 2), tuple(c.token_ids))) for c in firsts
        ))
        return firsts, seconds

    firsts, seconds = asyncio.run(group())
    assert calls[0] == ((1, 2), 4), "the first turn is one request of n = group size"
    assert sorted(c.text for c in firsts) == ["0", "1", "2", "3"], "every game gets a different sample"
    assert sorted(n for _, n in calls[1:]) == [2, 2], "each later prompt is one request for the games that reached it"
    assert sorted(c.text for c in seconds) == ["0", "0", "1", "1"]


def test_greedy_answers_ask_once_per_distinct_prompt():
    generate, calls = recording_generate(lambda i: 7)
    greedy = GreedyAnswers(generate, {"temperature": 0.0})

    async def evaluation():
        return await asyncio.gather(*(greedy.answer([5, p % 3]) for p in range(12)))

    answers = asyncio.run(evaluation())
    assert len(answers) == 12 and sorted(set(calls)) == [((5, 0), 1), ((5, 1), 1), ((5, 2), 1)]
    assert len(calls) == 3


def test_seeded_requests_depend_on_the_deal_and_prompt_not_on_timing():
    """A resumed run must sample what the uninterrupted run sampled: each request's vLLM seed is a function of
    (run seed, deal), the prompt and how many requests that prompt had before, not of which game asked first."""

    def seeds_of(order):
        sent = []

        async def generate(prompt_ids, sampling):
            sent.append((tuple(prompt_ids), sampling["n"] if "n" in sampling else 1, sampling["seed"]))
            return [Completion(prompt_ids=list(prompt_ids), token_ids=[10 + i], logprobs=[-0.5], text=str(i),
                               finish_reason="length", policy_version=0) for i in range(sampling.get("n", 1))]

        shared = SharedRequests(generate, 2, {"temperature": 1.0}, seed=(0, 123))

        async def group():
            firsts = await asyncio.gather(*(shared.answer([1, 2]) for _ in range(2)))
            for c in sorted(firsts, key=lambda c: c.token_ids, reverse=order):  # games move on in either order
                await shared.answer([1, 2, *c.token_ids], ((1, 2), tuple(c.token_ids)))

        asyncio.run(group())
        return sorted(sent)

    assert seeds_of(False) == seeds_of(True)
    seeds = [seed for _, _, seed in seeds_of(False)]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**62 for s in seeds)
    other_deal = SharedRequests(None, 2, {}, seed=(0, 124))._params((1, 2))["seed"]
    assert other_deal not in seeds
