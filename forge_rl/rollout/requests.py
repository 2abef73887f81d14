"""Where a group's or an evaluation's answers come from: requests shared between games at the same prompt.

    SharedRequests   training: games at the same prompt share one request of n samples, each seeded
    GreedyAnswers    evaluation: one greedy request per distinct prompt, its answer given to every game there
"""

from __future__ import annotations

import asyncio
import hashlib

from forge_rl.core.types import Completion


class SharedRequests:
    """The games of a group ask the policy together: games at the same prompt share one request of n samples.

    A group's games are dealt from one seed in a deterministic environment, so games that answered alike so far
    stand at the same prompt; one request of n samples costs one message and one prefill instead of n. Each
    sample goes to one game only; a game whose prompt differs from its siblings' asks alone.

    With `seed`, every request's vLLM seed derives from it, the prompt and that prompt's earlier requests in
    the group, so the games depend on the weights and the deal alone and a resumed run samples the same.
    """

    def __init__(self, generate, group_size: int, sampling: dict, seed: tuple | None = None):
        self.generate, self.group_size, self.sampling, self.seed = generate, group_size, sampling, seed
        self.shared: dict[tuple, list] = {}  # prompt ids -> [future of its n completions, n, how many taken]
        self.reached: dict = {}  # (previous prompt ids, previous answer ids), None first -> prompt reached
        self.requests_at: dict[tuple, int] = {}  # prompt ids -> requests sent for it so far

    def _params(self, prompt: tuple, **extra) -> dict:
        params = {**self.sampling, **extra}
        if self.seed is not None:
            k = self.requests_at[prompt] = self.requests_at.get(prompt, -1) + 1
            params["seed"] = request_seed(self.seed, prompt, k)
        return params

    async def answer(self, prompt_ids: list[int], previous: tuple | None = None) -> Completion:
        """A completion for this game. `previous`: (prompt ids, answer ids) of its previous turn, None on its first."""
        prompt = tuple(prompt_ids)
        if previous is None:
            n = self.group_size
        else:
            before = self.shared.get(previous[0])
            n = sum(tuple(c.token_ids) == previous[1] for c in before[0].result()) if before else 1
        if self.reached.setdefault(previous, prompt) != prompt:
            n = 1
        request = self.shared.get(prompt)
        if request is None and n > 1:
            request = self.shared[prompt] = [asyncio.ensure_future(self.generate(list(prompt), self._params(prompt, n=n))), n, 0]
        if request is None or request[2] >= request[1]:
            (completion,) = await self.generate(list(prompt), self._params(prompt))
            return completion
        index, request[2] = request[2], request[2] + 1  # taken before awaiting: the other games take theirs meanwhile
        return (await asyncio.shield(request[0]))[index]


def request_seed(base: tuple, prompt: tuple, k: int) -> int:
    """A vLLM sampling seed that depends on nothing but its arguments (not on Python's hash salt); 62 bits, as
    vLLM adds the sample index to it and keeps it in an int64."""
    digest = hashlib.blake2b(repr((base, prompt, k)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class GreedyAnswers:
    """Greedy decoding is a function of the prompt under fixed weights, so games reaching the same prompt share
    one answer, and many deals cost little more than a few."""

    def __init__(self, generate, sampling: dict):
        self.generate, self.sampling = generate, sampling
        self.answers: dict[tuple, asyncio.Future] = {}  # prompt ids -> future of its one completion

    async def answer(self, prompt_ids: list[int], previous: tuple | None = None) -> Completion:
        prompt = tuple(prompt_ids)
        if prompt not in self.answers:
            self.answers[prompt] = asyncio.ensure_future(self.generate(list(prompt), self.sampling))
        return (await asyncio.shield(self.answers[prompt]))[0]
