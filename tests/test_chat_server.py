"""The chat server as agents meet it: stock `openai` and `anthropic` SDK clients against
`python -m forge_rl.chat_server` (a subprocess serving a real vLLM policy through Monarch).

Two policies (tests/chat_helpers.py): the tiny model as built (random weights, word-level tokenizer,
ChatML) for token identity, sealing, retries, streaming, sampling and errors; and the tiny model
scripted to answer with a tool call or a <think> block, under a Qwen3-like template, for tool calls
and history rewriting. tests/test_chat_server_bpe.py repeats the identity tests with a byte-level BPE.
"""

import asyncio
import contextlib
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from anthropic import BadRequestError as AnthropicBadRequest
from anthropic import NotFoundError as AnthropicNotFound
from openai import BadRequestError, NotFoundError
from transformers import AutoTokenizer

from forge_rl.models.tiny import build_tiny_model
from tests.chat_helpers import (
    RUN_PYTHON,
    THINK_TEXT,
    TOOL_CALL_JSON,
    TURNS,
    ChatServerProcess,
    anthropic_client,
    build_scripted_model,
    check_assistant_edited,
    check_compaction,
    check_retry_and_streaming,
    check_three_turns_and_anthropic,
    openai_client,
    run,
    sampled_runs,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_tiny")
    model = build_tiny_model(tmp / "model", seed=0)
    server = ChatServerProcess(tmp, model)
    try:
        yield SimpleNamespace(server=server, tokenizer=AutoTokenizer.from_pretrained(model))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_scripted")
    model = build_scripted_model(tmp / "model")
    server = ChatServerProcess(tmp, model, "chat.tool_parser=hermes", "sampling.max_tokens=8", max_model_len=256)
    try:
        yield SimpleNamespace(server=server, tokenizer=AutoTokenizer.from_pretrained(model))
    finally:
        server.stop()


def test_three_turns_give_one_segment_of_exact_ids_and_anthropic_the_identical_trajectory(tiny):
    check_three_turns_and_anthropic(tiny.server, tiny.tokenizer)


def test_compaction_gives_two_segments_and_one_advantage_for_the_rollout(tiny):
    check_compaction(tiny.server)


def test_an_edited_assistant_message_seals_the_segment(tiny):
    check_assistant_edited(tiny.server)


def test_a_retry_gets_the_recorded_reply_and_streaming_records_what_plain_does(tiny):
    check_retry_and_streaming(tiny.server)


def test_sampling_comes_from_the_run_config_not_the_caller(tiny):
    server = tiny.server
    rollouts = [server.open() for _ in range(6)]

    async def ask(rollout):
        client = openai_client(server.base_url(rollout))
        messages = [{"role": "user", "content": TURNS[0]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, temperature=0.01, top_p=0.01, max_tokens=2)
        return reply.choices[0].message.content

    async def ask_all():
        return await asyncio.gather(*(ask(r) for r in rollouts))

    replies = run(ask_all())
    assert len(set(replies)) > 1, "temperature 0.01 from the caller must not make the policy greedy"
    assert all(len(sampled_runs(server.trajectory(r)["segments"][0])[0]) == 6 for r in rollouts), "max_tokens is the config's"


def test_bad_requests_get_protocol_errors_and_leave_the_record_unharmed(tiny):
    server, rollout = tiny.server, tiny.server.open()
    messages = [{"role": "user", "content": TURNS[0]}]

    async def agent():
        client = openai_client(server.base_url(rollout), max_retries=0)
        anthropic = anthropic_client(server.anthropic_base_url(rollout), max_retries=0)
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
        before = server.trajectory(rollout)
        errors = []
        with pytest.raises(NotFoundError) as e:
            await client.chat.completions.create(model="gpt-4", messages=messages)
        errors.append(e.value.body)
        with pytest.raises(AnthropicNotFound):
            await anthropic.messages.create(model="claude", max_tokens=8, messages=messages)
        with pytest.raises(BadRequestError) as e:  # past max_model_len (192)
            await client.chat.completions.create(model="policy", messages=messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "hit " * 200}])
        errors.append(e.value.body)
        with pytest.raises(AnthropicBadRequest):
            await anthropic.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hit " * 200}])
        async with httpx.AsyncClient() as http:
            bad_json = await http.post(f"{server.base_url(rollout)}/chat/completions", content=b"{not json")
            bad_anthropic = await http.post(f"{server.anthropic_base_url(rollout)}/v1/messages", json={"model": "policy"})
            unknown = await http.post(f"{server.url}/s/nobody/v1/chat/completions", json={"model": "policy", "messages": messages})
            bad_rewards = [await http.post(f"{server.url}/s/{rollout}/end", content=body)  # json.loads reads NaN too
                           for body in (b'{"reward": NaN}', b'{"reward": -Infinity}', b'{"reward": "0.7"}', b'{"reward": true}')]
        assert [(r.status_code, r.json()["error"]["code"]) for r in bad_rewards] == [(400, "reward_not_finite")] * 2 + [(400, "reward_not_a_number")] * 2
        assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
        assert bad_anthropic.status_code == 400 and bad_anthropic.json()["type"] == "error"
        assert unknown.status_code == 404 and "unknown rollout" in unknown.json()["error"]["message"]
        assert server.trajectory(rollout) == before, "a refused request must leave the record as it was"
        # and the conversation goes on in the same segment
        await client.chat.completions.create(model="policy", messages=messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": TURNS[1]}])
        server.end(rollout, 0.0)
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model="policy", messages=messages)
        errors.append(e.value.body)
        return errors

    not_served, too_long, ended = run(agent())
    assert not_served["code"] == "model_not_found" and too_long["code"] == "context_length_exceeded"
    assert ended["code"] == "rollout_ended"


# ---- tool calls and history rewriting: the scripted policy ------------------------------------------


async def until(first_reply, attempts: int = 25):
    """Open rollouts until the policy's first reply satisfies `first_reply` (it starts a chain with p ~0.4)."""
    for _ in range(attempts):
        result = await first_reply()
        if result is not None:
            return result
    raise AssertionError(f"no wanted reply in {attempts} rollouts")


def tool_results_text() -> str:
    return "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nsecond\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def check_tool_round_trip(scripted, rollout: str) -> list[int]:
    (segment,) = scripted.server.trajectory(rollout)["segments"]
    assert segment["sealed_reason"] is None
    first_reply = sampled_runs(segment)[0]
    assert scripted.tokenizer.decode(first_reply) == f"<tool_call>{TOOL_CALL_JSON}</tool_call><|im_end|>"
    end = segment["token_ids"].index(first_reply[-1], segment["sampled"].index(True)) + 1
    added = segment["token_ids"][end : segment["sampled"].index(True, end)]
    assert added == scripted.tokenizer(tool_results_text(), add_special_tokens=False)["input_ids"], "both tool results, tokenized alone"
    return segment["token_ids"][: segment["sampled"].index(True, end)]


def test_tool_calls_round_trip_through_the_openai_sdk(scripted):
    server = scripted.server

    async def first_reply():
        rollout = server.open()
        client = openai_client(server.base_url(rollout))
        messages = [{"role": "user", "content": "what is six times seven"}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[RUN_PYTHON])
        return (rollout, client, messages, reply) if reply.choices[0].message.tool_calls else None

    async def agent():
        rollout, client, messages, reply = await until(first_reply)
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "run_python" and json.loads(call.function.arguments) == {"code": "print(6*7)"}
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))  # the SDK's own message, sent back
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "42"}, {"role": "tool", "tool_call_id": call.id, "content": "second"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[RUN_PYTHON], stream=True)
        return rollout

    check_tool_round_trip(scripted, run(agent()))


def test_tool_calls_round_trip_through_the_anthropic_sdk(scripted):
    server = scripted.server
    tool = {"name": "run_python", "description": RUN_PYTHON["function"]["description"], "input_schema": RUN_PYTHON["function"]["parameters"]}

    async def first_reply():
        rollout = server.open()
        client = anthropic_client(server.anthropic_base_url(rollout))
        messages = [{"role": "user", "content": "what is six times seven"}]
        reply = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[tool])
        return (rollout, client, messages, reply) if reply.stop_reason == "tool_use" else None

    async def agent():
        rollout, client, messages, reply = await until(first_reply)
        (call,) = [b for b in reply.content if b.type == "tool_use"]
        assert call.name == "run_python" and call.input == {"code": "print(6*7)"}
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "42"},
            {"type": "tool_result", "tool_use_id": call.id, "content": "second"},
        ]})
        async with client.messages.stream(model="policy", max_tokens=64, messages=messages, tools=[tool]) as stream:
            await stream.get_final_message()
        return rollout

    prompt = check_tool_round_trip(scripted, run(agent()))
    # the conversation's first prompt is the template's render with the tools, as through the OpenAI SDK
    first = scripted.tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is six times seven"}], tools=[RUN_PYTHON], tokenize=False, add_generation_prompt=True
    )
    first_ids = scripted.tokenizer(first, add_special_tokens=False)["input_ids"]
    assert prompt[: len(first_ids)] == first_ids


def test_a_template_that_drops_earlier_think_blocks_seals_the_segment(scripted):
    server = scripted.server

    async def first_reply():
        rollout = server.open()
        client = openai_client(server.base_url(rollout))
        messages = [{"role": "user", "content": "hit or stand"}]
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
        return (rollout, client, messages, reply) if reply == THINK_TEXT else None

    async def agent():
        rollout, client, messages, reply = await until(first_reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and now"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return rollout

    segments = server.trajectory(run(agent()))["segments"]
    assert [s["sealed_reason"] for s in segments] == ["template_rewrite", None]
    # the new segment is the rewritten history rendered whole: the earlier turn without its <think> block
    text = scripted.tokenizer.decode(segments[1]["token_ids"][: segments[1]["sampled"].index(True)])
    assert "<|im_start|>assistant\nHIT<|im_end|>" in text and "<think>" not in text


def test_the_code_agent_runs_its_tool_calls_in_the_code_interpreter(scripted):
    """apps/code_agent: the policy's run_python call runs in the sandbox, and what it printed is the next turn."""
    from apps.code_agent.agent import run_agent
    from forge_rl.rollout.agents import AgentContext, EnvRecorder
    from forge_rl.rollout.env_client import EnvSession
    from forge_rl.envs.local import launch_local

    server = scripted.server

    async def one_agent(url):
        rollout = server.open()
        async with EnvSession(url) as session:
            env = EnvRecorder(session)
            ctx = AgentContext(server.base_url(rollout), server.anthropic_base_url(rollout), "any", "policy", 0, env)
            assert await run_agent(ctx) is None
        assert env.last.done and env.last.reward == 0.0, "the answer is graded by the task's tests"
        (segment,) = server.trajectory(rollout)["segments"]
        return segment if scripted.tokenizer.decode(sampled_runs(segment)[0]).startswith("<tool_call>") else None

    async def agents(url):
        for _ in range(25):
            segment = await one_agent(url)
            if segment is not None:
                return segment
        raise AssertionError("the policy never called the tool")

    with launch_local("apps.coder.interpreter:CodeInterpreterEnvironment", timeout_s=300) as interpreter:
        segment = run(agents(interpreter.url))
    start = segment["sampled"].index(False, segment["sampled"].index(True))
    added = segment["token_ids"][start : segment["sampled"].index(True, start)]
    result = "\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert added == scripted.tokenizer(result, add_special_tokens=False)["input_ids"]


def test_sigterm_stops_a_serving_chat_server_holding_a_rollout_and_requests_in_flight(tmp_path):
    """As `timeout`, kubectl or a script's background job stop it (SIGTERM, SIGINT ignored): with a rollout
    open, a request generating and another whose body is still arriving, the server stops cleanly (no
    forced exit), within its bound, and its actor and engine processes end with it."""
    import signal
    import socket
    import threading

    import psutil

    from forge_rl.chat_server import STOP_BOUND_S

    model = build_tiny_model(tmp_path / "model", seed=0)
    server = ChatServerProcess(tmp_path, model, "sampling.max_tokens=400", max_model_len=1024, sigint_ignored=True)
    try:
        rollout = server.open()
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": TURNS[0]}]})
        arriving = socket.create_connection(("127.0.0.1", server.port))
        arriving.sendall(f"POST /s/{rollout}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body[:10]}".encode())

        def generating():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{server.base_url(rollout)}/chat/completions", content=body, timeout=300)

        threading.Thread(target=generating, daemon=True).start()
        time.sleep(1.0)
        spawned = psutil.Process(server.proc.pid).children(recursive=True)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(STOP_BOUND_S + 15)  # raises if it still serves
        log = server.log_path.read_text()
        assert server.proc.returncode == 0 and "chat server stopped" in log and "did not exit within" not in log, log[-3000:]
        _, alive = psutil.wait_procs(spawned, timeout=30)
        assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
        arriving.close()
    finally:
        server.stop()
