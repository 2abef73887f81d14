"""RequestBatcher alone, on CPU: which calls it sends and which result each caller gets.

`send` here is a plain function that records the batches it is given (tests/test_generator.py checks
Generator.generate_batch on the real engine)."""

import asyncio

import pytest

from forge_rl.rollout.batching import RequestBatcher


def recording_send(fail_prompt=None, fail_call=False):
    batches = []

    async def send(requests):
        batches.append([tuple(p) for p, _ in requests])
        await asyncio.sleep(0.01)  # the call is in flight while more requests arrive
        if fail_call:
            raise ConnectionError("policy service lost")
        return [ValueError(f"bad prompt {p}") if tuple(p) == fail_prompt else [("answer", tuple(p), s["n"])] for p, s in requests]

    return send, batches


def test_requests_made_while_a_call_is_out_travel_together_and_each_caller_gets_its_own():
    send, batches = recording_send()
    batcher = RequestBatcher(send, max_in_flight=1, max_wait_s=1.0)

    async def games():
        first = asyncio.ensure_future(batcher.generate([0], {"n": 1}))
        await asyncio.sleep(0)  # the first request is sent alone: nothing is in flight
        rest = [batcher.generate([i], {"n": i}) for i in range(1, 6)]
        return await asyncio.gather(first, *rest)

    results = asyncio.run(games())
    assert batches == [[(0,)], [(1,), (2,), (3,), (4,), (5,)]], "one call for all that arrived while the first was out"
    assert results == [[("answer", (i,), max(i, 1) if i else 1)] for i in range(6)]


def test_a_request_waits_at_most_max_wait_s_for_the_call_in_flight():
    async def slow(requests):
        await asyncio.sleep(0.5)
        return [[len(p)] for p, _ in requests]

    batcher = RequestBatcher(slow, max_in_flight=1, max_wait_s=0.02)

    async def games():
        first = asyncio.ensure_future(batcher.generate([0], {}))
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        second = asyncio.ensure_future(batcher.generate([1, 2], {}))
        await asyncio.sleep(0.1)
        sent = batcher.in_flight  # the second went out after max_wait_s, without waiting for the first
        return await first, await second, sent, loop.time() - start

    first, second, in_flight, _ = asyncio.run(games())
    assert (first, second, in_flight) == ([1], [2], 2)


def test_a_failed_request_fails_its_caller_only_and_a_failed_call_fails_all_it_carried():
    send, _ = recording_send(fail_prompt=(2,))
    batcher = RequestBatcher(send)

    async def games(b):
        return await asyncio.gather(*(b.generate([i], {"n": 1}) for i in range(4)), return_exceptions=True)

    results = asyncio.run(games(batcher))
    assert isinstance(results[2], ValueError) and all(isinstance(r, list) for i, r in enumerate(results) if i != 2)
    send, _ = recording_send(fail_call=True)
    results = asyncio.run(games(RequestBatcher(send)))
    assert all(isinstance(r, ConnectionError) for r in results)
    with pytest.raises(ConnectionError):
        asyncio.run(RequestBatcher(send).generate([1], {}))


def test_a_call_answering_another_number_of_results_fails_every_request_it_carried():
    """A replica answering once per rank (what a two-rank generator mesh did) pairs its answers with the
    wrong requests and leaves the rest unanswered: every caller gets an error instead, none waits forever."""

    async def per_rank(requests):
        return [[("rank", r)] for r in range(2)]

    batcher = RequestBatcher(per_rank, max_in_flight=1, max_wait_s=1.0)

    async def games():
        first = asyncio.ensure_future(batcher.generate([0], {}))
        await asyncio.sleep(0)
        rest = [batcher.generate([i], {}) for i in range(1, 6)]
        return await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 10)

    results = asyncio.run(games())
    assert all(isinstance(r, RuntimeError) and "2 results for" in str(r) for r in results), results
