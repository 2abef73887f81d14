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

    A group's games are dealt from one seed and the environment is deterministic in its seed and the
    actions taken, so games that have answered alike so far stand at the same prompt: all G of them at
    the first turn, and at each later turn those that sampled the same answers. One request for n samples
    costs one message and one prefill where n requests cost n of each (on 2 CPU cores per-request
    overhead, not the model, bounds how fast games are played). How many games will reach a prompt is
    known from the request before it: those that drew the same answer there. Each sample goes to one
    game only. A game whose prompt is not the one its siblings reached (an environment that is not
    deterministic in its seed) asks alone. `generate(prompt_ids, sampling) -> list[Completion]`.

    With `seed` (the run's seed and the group's deal) every request carries a vLLM sampling seed derived
    from it, the prompt and how many requests that prompt had before in this group: the group's games
    are then a function of the weights and the deal alone, whatever the timing, so a resumed run samples
    what the uninterrupted run sampled (vLLM gives the n samples of one request seeds seed, seed + 1, ...).
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
    """An evaluation's answers, one request per distinct prompt: greedy decoding is a function of the
    prompt (and the weights, which do not change during an evaluation), so games that reach the same
    prompt get the same answer without asking again. Thousands of deals then cost a few hundred
    requests, and evaluating on many deals (a precise EV) costs little more than on a few."""

    def __init__(self, generate, sampling: dict):
        self.generate, self.sampling = generate, sampling
        self.answers: dict[tuple, asyncio.Future] = {}  # prompt ids -> future of its one completion

    async def answer(self, prompt_ids: list[int], previous: tuple | None = None) -> Completion:
        prompt = tuple(prompt_ids)
        if prompt not in self.answers:
            self.answers[prompt] = asyncio.ensure_future(self.generate(list(prompt), self.sampling))
        return (await asyncio.shield(self.answers[prompt]))[0]
