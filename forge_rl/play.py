"""Playing: one game on an environment session, a group of games dealt from one seed, and where their
answers come from. Nothing here knows the rules of any game: the prompt, the parsing of an answer and
the reward are the app module's (`run.game`).

One game is one episode; its turns are one token sequence (forge_rl.rollout.Conversation): what the
policy sampled is kept as sampled, each new observation is tokenized alone and appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forge_rl.config import ConfigError, RunConfig
from forge_rl.envs.client import EnvSession, EpisodeAborted
from forge_rl.rollout import Conversation
from forge_rl.types import Completion, Episode

if TYPE_CHECKING:
    from forge_rl.grpo import Run

logger = logging.getLogger("forge_rl.play")




class SessionPool:
    """At most `size` environment sessions, each kept open and reused for one game after another
    (a WebSocket connection per game would cost more than the game). A session that raised out of a
    game is closed, not reused."""

    def __init__(self, url: str, size: int, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.free: asyncio.Queue = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(None)  # a slot without a session yet

    @contextlib.asynccontextmanager
    async def session(self):
        session = await self.free.get() or EnvSession(self.url, timeout_s=self.timeout_s)
        try:
            yield session
        except BaseException:
            broken, session = session, None
            await broken.close()
            raise
        finally:
            self.free.put_nowait(session)

    async def close(self) -> None:
        while not self.free.empty():
            session = self.free.get_nowait()
            if session is not None:
                await session.close()


class EnvironmentLost(RuntimeError):
    """No game can be played any more (the environment server stopped answering): the run stops."""


@dataclass
class GameResult:
    episodes: list[Episode]  # none when the game had no decision or was aborted; a chat agent's may be several
    reward: float
    invalid: bool  # ended by an answer the app's parse_action refused
    aborted: bool = False  # the environment session was lost and could not be restored


_PROMPTS_WITH_UNKNOWN_WORDS: list[str] = []  # the first one found is reported, once per run


def prompt_ids(game, tokenizer, observation: dict, first_turn: bool, close_previous: bool = False) -> list[int]:
    """Token ids of one user turn and the assistant header, tokenized on their own.

    The first turn comes from the chat template; later turns continue a conversation whose earlier ids
    are kept as sampled, so only the new text is tokenized (never the whole conversation again).
    `close_previous`: the previous answer stopped without the end-of-turn token (constrained decoding
    samples the answer alone), so this turn starts by closing it.
    """
    text, ids = _turn_ids(tokenizer, game.render_prompt(observation), first_turn)
    ids = list(ids)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids and not _PROMPTS_WITH_UNKNOWN_WORDS:
        _PROMPTS_WITH_UNKNOWN_WORDS.append(text)  # the prompt's words are the app's to fix
        logger.warning("the tokenizer does not know some words of this prompt (read as %s): %r", tokenizer.unk_token, text[:300])
    return [tokenizer.eos_token_id] + ids if close_previous else ids


@functools.lru_cache(maxsize=4096)
def _turn_ids(tokenizer, content: str, first_turn: bool) -> tuple[str, tuple[int, ...]]:
    """The text and ids of one user turn (see prompt_ids). Cached: a game's prompts repeat (BlackJack
    has a few hundred), and rendering the chat template three times per turn cost more than the model."""
    message = {"role": "user", "content": content}
    text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    if not first_turn:
        # The turn as the template renders it after an earlier one: without what it puts only at the start
        # (SmolLM2's default system prompt), after the newline it puts after the previous <|im_end|>.
        earlier = [{"role": "user", "content": "."}]
        before = tokenizer.apply_chat_template(earlier, tokenize=False)
        text = "\n" + tokenizer.apply_chat_template(earlier + [message], tokenize=False, add_generation_prompt=True)[len(before):]
    return text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_token_ids(game, tokenizer) -> list[int]:
    """For constrained decoding: the ids the policy may sample, each word of the app's ANSWER_VOCABULARY
    (answers of up to sampling.max_tokens tokens, e.g. "x*7") or else of its ACTIONS (one token each).

    The policy then samples only these ids (vLLM's allowed_token_ids), and the trainer and reference
    renormalise every position over the same ids: behaviour and trained log-probs are of one and the
    same distribution. The end-of-turn token after the answer is then the environment's, appended with
    the next turn (not trained).
    """
    ids = []
    for answer in getattr(game, "ANSWER_VOCABULARY", None) or game.ACTIONS:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(
                f"sampling.constrained needs each answer to be one token; {answer!r} is "
                f"{len(encoded)} tokens for this tokenizer: set sampling.constrained=false"
            )
        if tokenizer.unk_token_id is not None and encoded[0] == tokenizer.unk_token_id:
            raise ConfigError(
                f"answer {answer!r} of {game.__name__}.ACTIONS is not in the model's vocabulary (it is the "
                f"unknown token {tokenizer.unk_token!r}): use words the model knows (docs/blackjack_tiny_cpu.md) or set model.path"
            )
        ids += encoded
    return ids


def sampling(cfg: RunConfig, allowed_token_ids: list[int] | None, greedy: bool = False, answer_length: int = 1) -> dict:
    params = {"temperature": 0.0 if greedy else cfg.sampling.temperature, "max_tokens": cfg.sampling.max_tokens}
    if not greedy:
        params["top_p"] = cfg.sampling.top_p
    if allowed_token_ids:
        params.update(allowed_token_ids=allowed_token_ids, max_tokens=answer_length)
    return params


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


async def play_game(
    run: Run, seed: int, group_id: str, asks: SharedRequests | GreedyAnswers, reset_args: dict | None = None
) -> GameResult:
    """One whole game on its own environment session: observe, ask the policy, act, until done.
    `asks`: where the game's answers come from, shared with the other games of its group or evaluation.
    `reset_args`: besides the seed (the config's env.reset_args, or with eval.reset_args over them)."""
    cfg, game = run.cfg, run.game
    async with run.sessions.session() as session:
        try:
            observation = (await session.reset(seed=seed, **(reset_args or cfg.env.reset_args))).observation
            conversation, invalid = Conversation(prompt_ids(game, run.tokenizer, observation, True)), False
            previous = None  # (prompt ids, answer ids) of the last turn, for the group's shared requests
            for turn in range(cfg.rollout.max_turns):
                if observation["done"]:
                    break
                if turn:
                    unclosed = conversation.tokens[-1] != run.tokenizer.eos_token_id
                    conversation.add_turn(prompt_ids(game, run.tokenizer, observation, False, unclosed))
                completion = await asks.answer(conversation.prompt_ids, previous)
                previous = (tuple(completion.prompt_ids), tuple(completion.token_ids))
                conversation.add_completion(completion)
                action = game.parse_action(completion.text, observation)
                if action is None:
                    invalid = True
                    break
                observation = (await session.step(action)).observation
        except EpisodeAborted as e:
            logger.warning("game on seed %d dropped: %s", seed, e)
            run.last_abort = str(e)
            return GameResult([], 0.0, False, aborted=True)
    reward = game.reward(observation, invalid, cfg.rollout.invalid_action_penalty)
    episodes = [conversation.to_episode(reward, group_id)] if conversation.versions else []
    return GameResult(episodes, reward, invalid)


def player(run: Run):
    """play_game, or for a chat-agent app (one with run_agent) forge_rl.agents.play_agent: same arguments and result."""
    if hasattr(run.game, "run_agent"):
        from forge_rl.agents import play_agent

        return play_agent
    return play_game


async def play_group(run: Run, seed: int) -> list[Episode] | None:
    """G games dealt from one seed: the group GRPO compares (same cards, different decisions)."""
    shared = SharedRequests(
        run.generate, run.cfg.grpo.group_size, sampling(run.cfg, run.allowed_token_ids, answer_length=run.answer_length),
        seed=(run.cfg.seed, seed),
    )
    results = await asyncio.gather(
        *(player(run)(run, seed, f"seed{seed}", shared) for _ in range(run.cfg.grpo.group_size))
    )
    run.episodes_played += len(results)
    run.aborted_games += sum(r.aborted for r in results)
    run.groups_lost_in_a_row = run.groups_lost_in_a_row + 1 if all(r.aborted for r in results) else 0
    if run.groups_lost_in_a_row >= 20:
        raise EnvironmentLost(
            f"every game of the last {run.groups_lost_in_a_row} groups was aborted (last: {run.last_abort}): "
            "the environment server is gone; check env.url / env.server"
        )
    run.recent = (run.recent + [(r.reward, r.invalid) for r in results if not r.aborted])[-2000:]
    episodes = [e for r in results for e in r.episodes]
    return episodes if all(r.episodes for r in results) else None  # a group with a dropped game is not comparable
