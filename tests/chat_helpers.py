"""Running `python -m forge_rl.chat_server` for tests, and a tiny policy scripted to call tools and think.

The scripted policy is the tiny Qwen3 with its layers silenced (every attention and MLP output
projection is zero), so its next token depends on the last token alone: a bigram table, written into
lm_head. After the assistant header's newline it starts a Qwen-style tool call or a <think> block with
probability ~0.4 each (otherwise a random word), and once started finishes it deterministically:

    <tool_call>{"name":"run_python","arguments":{"code":"print(6*7)"}}</tool_call><|im_end|>
    <think>yes</think>HIT<|im_end|>

Its chat template is Qwen3's behaviour in small: tools listed in the system turn, tool calls as
<tool_call> JSON, consecutive tool results in one user turn, and <think> blocks of assistant turns
before the last user message dropped (history rewritten).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from forge_rl.core.config import GRPOConfig
from forge_rl.core.estimators import estimate
from forge_rl.core.net import free_port
from forge_rl.core.types import Episode
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.trainer import Trainer

SYSTEM = "Answer with one word"
TURNS = ["Dealer 10. You 17 soft. HIT or STAND?", "Dealer 6. You 12 hard. HIT or STAND?", "what is the sum"]
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "blackjack_agent_tiny_cpu.yaml"
TOOL_CALL_JSON = '{"name":"run_python","arguments":{"code":"print(6*7)"}}'
TOOL_CALL_TEXT = f"<tool_call>{TOOL_CALL_JSON}</tool_call>"
THINK_TEXT = "<think>yes</think>HIT"
RUN_PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run Python code and return what it prints",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- if '</think>' in content and loop.index0 < ns.last_user %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{ '<|im_start|>assistant\\n' + content }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' }}{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{ '</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_scripted_model(path: Path) -> Path:
    """The tiny model made into the scripted tool-calling, thinking policy described above."""
    build_tiny_model(path, seed=0)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    new = ["<tool_call>", "</tool_call>", "<think>", "</think>", TOOL_CALL_JSON]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in new])
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in ["Ċ", "yes", "HIT", "<|im_end|>", *new]}
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = vocab = tokenizer.get_vocab_size()
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = QWEN_LIKE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True))

    weights = load_file(str(path / "model.safetensors"))
    d = config["hidden_size"]
    g = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # rows for the added tokens
        old = weights[name]
        weights[name] = torch.cat([old, torch.randn(vocab - old.shape[0], d, generator=g) * 0.02])
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()  # the residual stream is the last token's embedding: a bigram model
    chain = [  # (from, to, logit): after the header's newline either chain may start, then it runs to the end
        ("Ċ", "<tool_call>", 7.15), ("Ċ", "<think>", 7.15),
        ("<tool_call>", TOOL_CALL_JSON, 40.0), (TOOL_CALL_JSON, "</tool_call>", 40.0), ("</tool_call>", "<|im_end|>", 40.0),
        ("<think>", "yes", 40.0), ("yes", "</think>", 40.0), ("</think>", "HIT", 40.0), ("HIT", "<|im_end|>", 40.0),
    ]
    sources = list(dict.fromkeys(a for a, _, _ in chain))
    for k, source in enumerate(sources):  # each source token's embedding is its own basis vector
        weights["model.embed_tokens.weight"][ids[source]] = torch.nn.functional.one_hot(torch.tensor(k), d).float()
    for source, target, logit in chain:  # RMSNorm makes a basis vector sqrt(d) long: logit = w * sqrt(d)
        weights["lm_head.weight"][ids[target], sources.index(source)] = logit / d**0.5
    save_file({k: weights[k].contiguous() for k in sorted(weights)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class ChatServerProcess:
    """`python -m forge_rl.chat_server` in a subprocess, with helpers to open rollouts and read them."""

    def __init__(self, tmp: Path, model_path: Path, *overrides: str, max_model_len: int = 192, sigint_ignored: bool = False):
        """`sigint_ignored`: started as a script's background job is (SIGINT ignored)."""
        self.port, self.log_path = free_port(), tmp / "chat_server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "forge_rl.chat_server", "--config", str(CONFIG), "--port", str(self.port),
            f"model.path={model_path}", f"run_dir={tmp / 'run'}", "sampling.constrained=false", "sampling.max_tokens=6",
            f"generator.max_model_len={max_model_len}", "generator.gpu_memory_utilization=0.01", *overrides,
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        deadline = time.time() + 600
        while time.time() < deadline:
            assert self.proc.poll() is None, f"chat server exited:\n{self.log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"chat server not up after 600 s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def open(self, greedy: bool = False) -> str:
        return httpx.post(f"{self.url}/rollouts", json={"greedy": greedy}, timeout=30).json()["rollout_id"]

    def base_url(self, rollout_id: str) -> str:
        return f"{self.url}/s/{rollout_id}/v1"

    def anthropic_base_url(self, rollout_id: str) -> str:
        return f"{self.url}/s/{rollout_id}"

    def trajectory(self, rollout_id: str) -> dict:
        response = httpx.get(f"{self.url}/s/{rollout_id}/trajectory", timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def end(self, rollout_id: str, reward: float | None) -> dict:
        return httpx.post(f"{self.url}/s/{rollout_id}/end", json={"reward": reward}, timeout=30).json()


_clients: list = []  # SDK clients opened by a test, closed by run() before its event loop ends


def openai_client(base_url: str, **kwargs) -> AsyncOpenAI:
    _clients.append(AsyncOpenAI(base_url=base_url, api_key="any", **kwargs))
    return _clients[-1]


def anthropic_client(base_url: str, **kwargs) -> AsyncAnthropic:
    _clients.append(AsyncAnthropic(base_url=base_url, api_key="any", **kwargs))
    return _clients[-1]


def run(coroutine):
    """asyncio.run, closing the SDK clients the coroutine opened."""

    async def main():
        try:
            return await coroutine
        finally:
            while _clients:
                await _clients.pop().close()

    return asyncio.run(main())


def sampled_runs(segment: dict) -> list[list[int]]:
    """The segment's sampled ids, one list per reply."""
    runs, previous = [], False
    for token, sampled in zip(segment["token_ids"], segment["sampled"]):
        if sampled and not previous:
            runs.append([])
        if sampled:
            runs[-1].append(token)
        previous = sampled
    return runs


# ---- checks shared by the word-level and the BPE tokenizer's tests ----------------------------------


async def openai_conversation(server, rollout_id, turns, stream=False, **extra) -> list[str]:
    """System prompt, then each turn: the reply is kept as the agent got it; the last turn is two
    user messages in a row (every message after the reply counts, not only the last one)."""
    client = openai_client(server.base_url(rollout_id))
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for i, turn in enumerate(turns):
        messages += [{"role": "user", "content": t} for t in ([turn, "Say HIT"] if i == len(turns) - 1 and i else [turn])]
        if stream:
            chunks = await client.chat.completions.create(model="policy", messages=messages, stream=True, **extra)
            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            content = (await client.chat.completions.create(model="policy", messages=messages, **extra)).choices[0].message.content
        replies.append(content or "")
        messages.append({"role": "assistant", "content": content})
    return replies


async def anthropic_conversation(server, rollout_id, turns) -> list[str]:
    client = anthropic_client(server.anthropic_base_url(rollout_id))
    messages, replies = [], []
    for i, turn in enumerate(turns):
        messages += [{"role": "user", "content": t} for t in ([turn, "Say HIT"] if i == len(turns) - 1 and i else [turn])]
        reply = await client.messages.create(model="policy", max_tokens=64, system=SYSTEM, messages=messages)
        text = "".join(b.text for b in reply.content if b.type == "text")
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    return replies


def chatml_user(*contents: str) -> str:
    """What follows a reply's end-of-turn token: the newline after it, the user turns, the assistant header."""
    return "\n" + "".join(f"<|im_start|>user\n{c}<|im_end|>\n" for c in contents) + "<|im_start|>assistant\n"


def expected_ids(tokenizer, segment: dict) -> list[int]:
    """The three-turn conversation's ids built independently: the first prompt rendered whole, then each
    reply as sampled (closed by <|im_end|> if it stopped without it), then each turn's text tokenized alone."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}], tokenize=False, add_generation_prompt=True
    )
    later = [chatml_user(TURNS[1]), chatml_user(TURNS[2], "Say HIT")]
    expected, runs = ids(first), sampled_runs(segment)
    for i, run in enumerate(runs):
        expected += run
        if i < len(later):
            expected += ([] if run[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]) + ids(later[i])
    return expected


def check_three_turn_trajectory(tokenizer, trajectory: dict, replies: list[str]) -> dict:
    (segment,) = trajectory["segments"]
    assert segment["sealed_reason"] is None
    assert segment["token_ids"] == expected_ids(tokenizer, segment)
    runs = sampled_runs(segment)
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs] == replies
    for sampled, logprob, version in zip(segment["sampled"], segment["logprobs"], segment["versions"]):
        assert (version == 0 and logprob <= 0) if sampled else (version is None and logprob == 0.0)
    return segment


def check_three_turns_and_anthropic(server, tokenizer):
    """Three turns through AsyncOpenAI: one segment of exact ids; the same conversation through AsyncAnthropic: the identical trajectory."""
    first, second = server.open(greedy=True), server.open(greedy=True)  # greedy: both SDKs get the same replies
    replies = run(openai_conversation(server, first, TURNS))
    segment = check_three_turn_trajectory(tokenizer, server.trajectory(first), replies)
    assert len(sampled_runs(segment)) == 3

    assert run(anthropic_conversation(server, second, TURNS)) == replies
    other = server.trajectory(second)["segments"]
    assert [s["token_ids"] for s in other] == [segment["token_ids"]]
    assert other[0]["sampled"] == segment["sampled"] and other[0]["versions"] == segment["versions"]
    torch.testing.assert_close(torch.tensor(other[0]["logprobs"]), torch.tensor(segment["logprobs"]))


def check_compaction(server):
    """Compaction: two segments, and one advantage for the rollout in its group."""
    compacted, plain = server.open(), server.open()

    async def agent():
        client = openai_client(server.base_url(compacted))
        messages = [{"role": "user", "content": TURNS[0]}]
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": TURNS[1]}]
        await client.chat.completions.create(model="policy", messages=messages)
        # the agent compacts: its history is now a summary and the new question
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a summary"}, messages[-1]])
        await openai_client(server.base_url(plain)).chat.completions.create(model="policy", messages=messages[:1])

    run(agent())
    segments = server.end(compacted, 1.0)["segments"]
    assert [s["sealed_reason"] for s in segments] == ["compaction", None]
    assert [len(sampled_runs(s)) for s in segments] == [2, 1]

    # the trainer's advantages: the compacted rollout's two segments count once in the group
    def episodes(trajectory, rollout_id):
        return [episode_of(s, trajectory["reward"], rollout_id) for s in trajectory["segments"]]

    batch = episodes(server.end(plain, 0.0), plain) + episodes({"reward": 1.0, "segments": segments}, compacted)
    advantages = [float(a[0]) for a in estimate(batch, GRPOConfig(estimator="dr_grpo"))]
    assert advantages == [-0.5, 0.5, 0.5]  # rollouts [0, 1]: mean 0.5; not [-2/3, 1/3, 1/3]


def episode_of(segment: dict, reward: float, rollout_id: str) -> Episode:
    """The Episode of a /trajectory segment, each sampled token with the version the server recorded for it."""
    versions = [-1 if v is None else v for v in segment["versions"]]
    return Episode(
        torch.tensor(segment["token_ids"]), torch.tensor(segment["sampled"]), torch.tensor(segment["logprobs"]), reward,
        min(v for v, s in zip(versions, segment["sampled"]) if s), "g", torch.tensor(versions), rollout_id,
    )


def check_assistant_edited(server):
    rollout = server.open()

    async def agent():
        client = openai_client(server.base_url(rollout))
        messages = [{"role": "user", "content": TURNS[0]}]
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
        messages += [{"role": "assistant", "content": reply + " STAND"}, {"role": "user", "content": TURNS[1]}]
        await client.chat.completions.create(model="policy", messages=messages)

    run(agent())
    assert [s["sealed_reason"] for s in server.trajectory(rollout)["segments"]] == ["assistant_edited", None]


def check_retry_and_streaming(server):
    """A retry gets the recorded reply; streamed and plain requests record the same tokens."""
    plain, streamed, retried = server.open(greedy=True), server.open(greedy=True), server.open()

    async def retry():
        client = openai_client(server.base_url(retried))
        messages = [{"role": "user", "content": TURNS[0]}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        again = await client.chat.completions.create(model="policy", messages=messages, stream=True)
        return first.choices[0].message.content, "".join([c.choices[0].delta.content or "" async for c in again if c.choices])

    first, again = run(retry())
    assert first == again
    (segment,) = server.trajectory(retried)["segments"]
    assert len(sampled_runs(segment)) == 1, "a retry must not sample again"

    replies = run(openai_conversation(server, plain, TURNS[:2]))
    assert run(openai_conversation(server, streamed, TURNS[:2], stream=True, stream_options={"include_usage": True})) == replies
    (one,), (other,) = server.trajectory(streamed)["segments"], server.trajectory(plain)["segments"]
    assert one["token_ids"] == other["token_ids"] and one["sampled"] == other["sampled"]
    torch.testing.assert_close(torch.tensor(one["logprobs"]), torch.tensor(other["logprobs"]))
