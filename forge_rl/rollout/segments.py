"""The exact token record of one chat-agent rollout, and how each chat request extends it.

Re-tokenizing a rendered conversation does not give back the sampled ids (byte-level BPE merges across a
reply's boundary; templates rewrite history), so the record keeps the ids themselves (Molt's segment sealing).

A request EXTENDS the open segment when its messages are the previous request's, then the reply the server
gave (content and tool calls), then new messages, and the template renders the previous prompt and the reply
as a prefix of the new conversation. The new prompt is then the segment's ids, the template's end-of-turn id
if the reply stopped without it, and the text after the reply tokenized alone. Otherwise the segment is SEALED
with a reason and a new one starts from a full render:

    compaction        the history before the reply is not the previous request's (turns dropped, summarised)
    assistant_edited  an assistant message differs from what the policy said, or the reply is missing
    template_rewrite  the template renders the shared prefix differently once more messages follow
                      (Qwen3 drops earlier <think> blocks; the tools changed)

Invariant (core/episode.py): token_ids[i] was sampled by the policy iff sampled[i]; then logprobs[i] is its
behaviour log-prob and versions[i] the policy version that sampled it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from forge_rl.core.episode import EpisodeRecord
from forge_rl.core.types import Completion
from forge_rl.rollout.tools import tools_in_system

SEAL_REASONS = ("compaction", "assistant_edited", "template_rewrite")


def normalize_message(message: dict) -> dict:
    """A message as compared and rendered; tool call ids dropped: an agent may rename them, no template renders them."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text reaches a text model
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    normalized = {"role": message.get("role"), "content": content or ""}
    calls = [
        {"type": "function", "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
        for c in message.get("tool_calls") or []
    ]
    if calls:
        normalized["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key):
            normalized[key] = message[key]
    return normalized


def _arguments(arguments) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


class Renderer:
    """The model's chat template and tokenizer, and the template's end-of-turn token."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})  # model.chat_template_kwargs
        self.end_text, self.end_id = end_of_turn(tokenizer)

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        """A template without a tool format gets the tools in the system message, as the environment form does."""
        text = self._apply(messages, tools, generation_prompt)
        if tools and text == self._apply(messages, None, generation_prompt):
            system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
            rest = messages[1:] if system is not None else messages
            text = self._apply([{"role": "system", "content": tools_in_system(system, tools)}, *rest], None, generation_prompt)
        return text

    def _apply(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.lru_cache(maxsize=16)
def end_of_turn(tokenizer) -> tuple[str, int]:
    """(text, id) of the token the template closes an assistant turn with: a base model's eos (Qwen's
    <|endoftext|>) need not be it. The eos when the template puts no special token after the reply."""
    mark = "forge_rl_reply_end"
    conversation = [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        after = text[text.index(mark) + len(mark) :]
    except Exception:  # no template, or one that drops the reply
        after = ""
    special = sorted((t for t in tokenizer.all_special_tokens if t and after.startswith(t)), key=len, reverse=True)
    if not special and tokenizer.eos_token is None:
        raise ValueError("a chat template that ends a turn with a special token is needed, or an eos token")
    end = special[0] if special else tokenizer.eos_token
    return end, tokenizer.convert_tokens_to_ids(end)


@dataclass
class Segment(EpisodeRecord):
    """Token ids of one stretch of a rollout that the policy saw as one growing prompt."""

    sealed_reason: str | None = None  # why no later request extends it (SEAL_REASONS); None while open
    # What the ids stand for, to judge the next request.
    messages: list[dict] = field(default_factory=list, repr=False)
    reply: dict | None = field(default=None, repr=False)
    prompt_text: str = field(default="", repr=False)

    def to_json(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "sampled": self.sampled,
            "logprobs": self.logprobs,
            "versions": [v if s else None for v, s in zip(self.versions, self.sampled)],
            "sealed_reason": self.sealed_reason,
        }


@dataclass
class Plan:
    """What a request does to the record: extend the open segment, or start a new one."""

    new_segment: bool
    token_ids: list[int]  # appended to the open segment, or the new segment's whole prompt
    prompt_text: str  # the request rendered with the generation prompt
    seal_reason: str | None = None  # set when the open segment must be sealed first


def plan_request(renderer: Renderer, segment: Segment | None, messages: list[dict], tools: list[dict] | None) -> Plan:
    """Pure: nothing changes until `commit`, so a failed request leaves the record as it was."""
    prompt_text = renderer.render(messages, tools, True)
    if segment is None or segment.sealed_reason or segment.reply is None:
        return Plan(True, renderer.ids(prompt_text), prompt_text)
    history = segment.messages + [segment.reply]
    reason = _divergence(history, messages)
    if reason is None:
        with_reply = renderer.render(history, tools, False)
        if not (with_reply.startswith(segment.prompt_text) and prompt_text.startswith(with_reply)):
            reason = "template_rewrite"
        else:
            reply_text = with_reply[len(segment.prompt_text) :]
            end = reply_text.rfind(renderer.end_text)
            after_end = reply_text[end + len(renderer.end_text) :] if end >= 0 else ""
            close = [] if segment.token_ids[-1] == renderer.end_id else [renderer.end_id]
            return Plan(False, close + renderer.ids(after_end + prompt_text[len(with_reply) :]), prompt_text)
    return Plan(True, renderer.ids(prompt_text), prompt_text, seal_reason=reason)


def _divergence(history: list[dict], messages: list[dict]) -> str | None:
    """None when `messages` start with `history` (previous messages + reply); else the seal reason."""
    for i, expected in enumerate(history):
        got = messages[i] if i < len(messages) else None
        if got == expected:
            continue
        if i == len(history) - 1 or (got is not None and got["role"] == expected["role"] == "assistant"):
            return "assistant_edited"
        return "compaction"
    return None


def commit(segments: list[Segment], plan: Plan, completion: Completion, messages: list[dict], reply: dict) -> None:
    """Record a request's plan and the completion the policy sampled for it."""
    if plan.new_segment:
        if segments and segments[-1].sealed_reason is None:
            segments[-1].sealed_reason = plan.seal_reason
        segments.append(Segment())
    segment = segments[-1]
    segment.add_prompt(plan.token_ids)
    segment.add_completion(completion)
    segment.messages, segment.reply, segment.prompt_text = messages, reply, plan.prompt_text
