"""Many games' generate requests, one call to the policy service.

    games (SharedRequests, GreedyAnswers) --generate(prompt ids, sampling)--> RequestBatcher
        --generate_batch([(prompt ids, sampling), ...])--> one Generator replica --[[Completion], ...]--> games

Each actor call costs a Monarch message each way, pickling and an asyncio round trip; with a tiny model
that, not the model, bounded how fast games were played. Each request keeps its own sampling and version.

Policy (Nagle's, with a bound): a request is sent at once when fewer than `max_in_flight` calls are out;
otherwise it waits for one to return, or at most `max_wait_s`. On a busy engine the batches grow, on an
idle one every request goes alone.
"""

from __future__ import annotations

import asyncio

from forge_rl.core.types import Completion


class RequestBatcher:
    """`generate(prompt_ids, sampling) -> list[Completion]`, as Rollouts.generate, for many concurrent callers.

    `send(requests) -> results`: per request its completions or its exception. Invariant: every request is
    sent exactly once and its caller gets its own result; a failed call fails only the requests it carried.
    """

    def __init__(self, send, max_in_flight: int = 1, max_wait_s: float = 0.01):
        self.send, self.max_in_flight, self.max_wait_s = send, max_in_flight, max_wait_s
        self.pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self.in_flight = 0
        self.timer: asyncio.TimerHandle | None = None

    async def generate(self, prompt_ids: list[int], sampling: dict) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), sampling, future))
        if self.in_flight < self.max_in_flight:
            asyncio.get_running_loop().call_soon(self._flush)  # after this tick: the callers ready now join it
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        self.in_flight += 1
        asyncio.ensure_future(self._call(batch))

    async def _call(self, batch: list) -> None:
        try:
            results = await self.send([(prompt, sampling) for prompt, sampling, _ in batch])
            if not isinstance(results, list) or len(results) != len(batch):  # else some futures never resolve
                raise RuntimeError(f"generate_batch answered {len(results) if isinstance(results, list) else type(results).__name__} "
                                   f"results for {len(batch)} requests")
        except BaseException as e:  # the call failed: so did every request it carried
            results = [e] * len(batch)
        finally:
            self.in_flight -= 1
            if self.pending:
                self._flush()
        for (_, _, future), result in zip(batch, results):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
