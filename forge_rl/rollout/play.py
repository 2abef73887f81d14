"""Playing one game: prompt ids, the policy's answer, the environment's step, until done. The rules are the app's.

One game is one episode, one token record (core/episode.py): what the policy sampled is kept as sampled,
and each new observation is tokenized alone and appended.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field

from forge_rl.core.app import App
from forge_rl.core.config import ConfigError, SamplingConfig
from forge_rl.core.episode import EpisodeRecord
from forge_rl.core.rewards import checked_reward
from forge_rl.core.types import Episode
from forge_rl.rollout.segments import end_of_turn
from forge_rl.rollout.tools import CALL_OPENING, is_tool_result, parse_tool_call, tool_result_text, tools_in_system

logger = logging.getLogger(__name__)


@dataclass
class GameResult:
    episodes: list[Episode]  # none when the game had no decision or was lost; a chat agent's may be several
    reward: float
    invalid: bool  # ended by an answer the app's parse_action refused
    lost: str = ""  # why the game has no result (rollouts.py): its session lost (session_lost), a reward refused, ...
    overflowed: bool = False  # cut off for a prompt of generator.max_model_len tokens
    # (prompt ids of the turn, the answer's text, the action parse_action made of it) per turn: samples.jsonl
    turns: list[tuple[list[int], str, dict | None]] = field(default_factory=list)
    observation: dict | None = None  # the last one the environment sent: what an app's eval_metrics may read
    env_s: float = 0.0  # seconds this game waited on its environment (reset and steps: a code server's grading)
    policy_s: float = 0.0  # seconds it waited on the policy's answers


_PROMPTS_WITH_UNKNOWN_WORDS: list[str] = []  # the first one found is reported, once per run


def prompt_ids(app: App, tokenizer, observation: dict, first_turn: bool, close_previous: bool = False,
               template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one user turn and the assistant header, tokenized on their own.

    Earlier ids are kept as sampled, so only the new text is tokenized. `close_previous`: the previous answer
    stopped without the end-of-turn token (constrained decoding, a stop string, max_tokens), so this turn
    closes it with the template's own (segments.py `end_of_turn`), which need not be the eos.
    """
    kwargs = tuple(sorted((template_kwargs or {}).items()))
    system, tools = getattr(app, "system_prompt", None), getattr(app, "tools", ())
    if tools and is_tool_result(observation):
        content, role = tool_result_text(observation), "tool"
    else:
        content, role = app.render_prompt(observation), "user"
    specs = json.dumps(tools) if tools and first_turn else ""
    text, ids = _turn_ids(tokenizer, content, first_turn, system, kwargs, role, specs)
    ids = list(ids)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids and not _PROMPTS_WITH_UNKNOWN_WORDS:
        _PROMPTS_WITH_UNKNOWN_WORDS.append(text)  # the prompt's words are the app's to fix
        logger.warning("the tokenizer reads %s as %s in this prompt: %r", unknown_words(tokenizer, text), tokenizer.unk_token, text[:300])
    return [end_of_turn(tokenizer)[1]] + ids if close_previous else ids


def unknown_words(tokenizer, text: str) -> list[str]:
    """The pieces of `text` the tokenizer reads as its unknown token (the tiny model's word list lacks them)."""
    if tokenizer.unk_token_id is None:
        return []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces = (text[a:b].strip() for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]) if i == tokenizer.unk_token_id)
    return list(dict.fromkeys(pieces))


@functools.lru_cache(maxsize=4096)
def _turn_ids(tokenizer, content: str, first_turn: bool, system: str | None, kwargs: tuple, role: str = "user",
              tools: str = "") -> tuple[str, tuple[int, ...]]:
    """`tools`: the function specs as JSON, for the first turn. Cached: a game's prompts repeat, and rendering
    the template three times per turn cost more than the model."""
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, **dict(kwargs))
    message = {"role": role, "content": content}
    start = [{"role": "system", "content": system}] if system is not None else []
    text = render(start + [message], add_generation_prompt=True)
    if tools:
        with_tools = render(start + [message], add_generation_prompt=True, tools=json.loads(tools))
        if with_tools == text:  # the template has no tool format: the tools go into the system message
            start = [{"role": "system", "content": tools_in_system(system, json.loads(tools))}]
            with_tools = render(start + [message], add_generation_prompt=True)
        text = with_tools
    if not first_turn:
        # The turn as the template renders it after an earlier one: without what it puts only at the start
        # (SmolLM2's default system prompt), after the newline it puts after the previous <|im_end|>.
        earlier = [{"role": "user", "content": "."}]
        before = render(earlier)
        text = "\n" + render(earlier + [message], add_generation_prompt=True)[len(before):]
    return text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_token_ids(app: App, tokenizer) -> list[int]:
    """For constrained decoding: each word of the app's ANSWER_VOCABULARY, else of its ACTIONS, one token each.

    The trainer and reference renormalise over the same ids, so behaviour and trained log-probs are of one
    distribution. The end-of-turn token is then appended with the next turn, untrained.
    """
    ids = []
    for answer in app.answers:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(
                f"sampling.constrained needs each answer to be one token; {answer!r} is "
                f"{len(encoded)} tokens for this tokenizer: set sampling.constrained=false"
            )
        if tokenizer.unk_token_id is not None and encoded[0] == tokenizer.unk_token_id:
            raise ConfigError(
                f"answer {answer!r} of {app.name} is not in the model's vocabulary (it is the "
                f"unknown token {tokenizer.unk_token!r}): use words the model knows (forge_rl/models/tiny.py lists the tiny model's) or set model.path"
            )
        ids += encoded
    return ids


def sampling_params(config: SamplingConfig, allowed_token_ids: list[int] | None, greedy: bool = False, answer_length: int = 1) -> dict:
    """An answer ended by a stop string keeps it in its text, so the app sees the closing fence."""
    params = {"temperature": 0.0 if greedy else config.temperature, "max_tokens": config.max_tokens}
    if not greedy:
        params["top_p"] = config.top_p
    if config.stop:
        params.update(stop=list(config.stop), include_stop_str_in_output=True)
    if allowed_token_ids:
        params.update(allowed_token_ids=allowed_token_ids, max_tokens=answer_length)
    return params


async def play_game(rollouts, seed: int, group_id: str, asks, reset_args: dict | None = None) -> GameResult:
    """One whole game on its own environment session. `asks` (requests.py) is shared with the other games of
    its group; `reset_args` default to the config's env.reset_args."""
    cfg, app, tokenizer = rollouts.cfg, rollouts.app, rollouts.tokenizer
    clock = {"env": 0.0, "policy": 0.0}

    async def timed(kind: str, call):
        start = time.perf_counter()
        try:
            return await call
        finally:
            clock[kind] += time.perf_counter() - start

    async with rollouts.sessions.session() as session:
        observation = (await timed("env", session.reset(seed=seed, **(reset_args or cfg.env.reset_args)))).observation
        template = cfg.model.chat_template_kwargs
        # sampling.tool_choice "required": each answer opens with the call's tag, given as the prompt's end
        opening = CALL_OPENING if cfg.sampling.tool_choice == "required" and app.parse_action is parse_tool_call else ""
        opening_ids = tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
        prompt = prompt_ids(app, tokenizer, observation, True, template_kwargs=template) + opening_ids
        record, invalid, overflowed, turns = EpisodeRecord(), False, False, []
        previous = None  # (prompt ids, answer ids) of the last turn, for the group's shared requests
        for turn in range(cfg.rollout.max_turns):
            if observation["done"]:
                break
            if turn:
                unclosed = record.token_ids[-1] != end_of_turn(tokenizer)[1]
                prompt = prompt_ids(app, tokenizer, observation, False, unclosed, template) + opening_ids
            # vLLM refuses a prompt of max_model_len tokens: cut off there, as at max_turns
            if overflowed := len(record.token_ids) + len(prompt) >= cfg.generator.max_model_len:
                break
            record.add_prompt(prompt)
            completion = await timed("policy", asks.answer(list(record.token_ids), previous))
            previous = (tuple(completion.prompt_ids), tuple(completion.token_ids))
            record.add_completion(completion)
            action = app.parse_action(opening + completion.text, observation)
            turns.append((prompt, opening + completion.text, action))
            if action is None:
                invalid = True
                break
            observation = (await timed("env", session.step(action))).observation
    if not overflowed and (invalid or observation["done"]):
        reward = checked_reward(app.reward(observation, invalid, cfg.rollout.invalid_action_penalty), f"{app.name}.reward")
    else:  # cut off: never scored better than losing (schema.py, rollout.cutoff_reward)
        reward = cfg.rollout.cutoff_score
    episodes = [record.to_episode(reward, group_id)] if record.completion_versions else []
    return GameResult(episodes, reward, invalid, turns=turns, observation=observation, env_s=clock["env"],
                      policy_s=clock["policy"], overflowed=overflowed)
