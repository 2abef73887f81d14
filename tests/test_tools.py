"""MCP tool environments in the environment form (forge_rl/rollout/tools.py), against a real MCPEnvironment:
the code tools server (apps/coder/tools_env.py) launched on 127.0.0.1 in the servers' virtualenv. Its tools are
listed over MCP, rendered into the first prompt by the chat template, a tool call in an answer becomes a
call_tool step, the tool's result the next turn, and submit's grade the episode's reward."""

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from forge_rl.core.app import load_app, terminal_reward
from forge_rl.core.config import load_config
from forge_rl.core.types import Completion
from forge_rl.envs.local import launch_local
from forge_rl.models.tiny import build_tiny_model
from forge_rl.recipes.metrics import read_metrics
from forge_rl.rollout.agents import EnvRecorder
from forge_rl.rollout.env_client import EnvSession
from forge_rl.rollout.play import play_game, prompt_ids
from forge_rl.rollout.rollouts import Rollouts
from forge_rl.rollout.segments import Renderer
from forge_rl.rollout.tools import HERMES_TOOLS, function_specs, list_tools, parse_tool_call, tool_result_text, with_tools
from tests.chat_helpers import CONFIG, ROOT, build_scripted_model

SERVER = "apps.coder.tools_env:CodeToolsEnvironment"
SOLUTION = "def remainder_ten(n):\n    return n % 10\n"  # the task of seed 3 (train split of `functions`)


@pytest.fixture(scope="module")
def server():
    with launch_local(SERVER, max_concurrent_envs=8, timeout_s=180) as server:
        yield server


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tools_are_listed_over_mcp_and_called_as_steps(server):
    tools = asyncio.run(list_tools(server.url, 30))
    assert [t["name"] for t in tools] == ["run_python", "submit"]
    specs = function_specs(tools)
    assert specs[0]["type"] == "function" and specs[0]["function"]["parameters"]["properties"] == {"code": {"type": "string"}}
    assert specs[0]["function"]["parameters"]["required"] == ["code"] and "sandbox" in specs[0]["function"]["description"]

    async def episode(program: str):
        async with EnvSession(server.url, restore="none") as session:
            first = await session.reset(seed=3)
            run = await session.step(parse_tool_call("let me try " + call("run_python", code="print(6*7)")))
            wrong = await session.step(parse_tool_call(call("nope")))
            end = await session.step(parse_tool_call(call("submit", code=program)))
            return first, run, wrong, end

    first, run, wrong, end = asyncio.run(episode(SOLUTION))
    assert first.observation["entry_point"] == "remainder_ten" and not first.done
    assert tool_result_text(run.observation) == "exit code 0\nstdout:\n42\n\nstderr:\n" and not run.done and run.reward is None
    assert tool_result_text(wrong.observation).startswith("error (tool_not_found)") and not wrong.done
    assert end.done and end.reward == 1.0 and tool_result_text(end.observation) == "passed: 10 of 10 hidden tests passed"
    assert terminal_reward(end.observation, False, 1.0) == 1.0
    _, _, _, failed = asyncio.run(episode("def remainder_ten(n):\n    return n\n"))
    assert failed.done and failed.reward < 1.0


def test_a_tool_call_is_parsed_only_when_it_is_one_and_any_text_is_survived():
    """vLLM's Hermes parser, the agent form's (chat.tool_parser: hermes), reads the call; arguments that are not a
    JSON object are no call, as the agent form's call_tool refuses them. The policy's own text, however deep its
    brackets, is read without an error (a RecursionError before)."""
    assert parse_tool_call('x <tool_call>\n{"name": "submit", "arguments": {"code": "1"}}\n</tool_call> y') == {
        "type": "call_tool", "tool_name": "submit", "arguments": {"code": "1"}}
    for text in ["<tool_call>" + "[" * 100_000 + "</tool_call>", "<tool_call>" + '{"a":' * 100_000, "HIT",
                 "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "submit", "arguments": [1]}</tool_call>', '<tool_call>{"name": "submit"',
                 '<tool_call>{"name": "submit", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>']:
        assert parse_tool_call(text) is None, text[:80]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The tiny model with a Qwen-style tool template (tests/chat_helpers.py)."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted"))


def tool_rollouts(tmp_path, model, url, *overrides) -> Rollouts:
    cfg = load_config(CONFIG, ["app_module=apps.coder.tools_task", "grpo.group_size=2", "env.max_concurrent=4",
                               "rollout.max_turns=4", *overrides])  # fmt: skip
    app = asyncio.run(with_tools(load_app(cfg.app_module), url, 30))
    return Rollouts(cfg, app, AutoTokenizer.from_pretrained(model), None, url, None)


class Scripted:
    """The answers of a game, in order, as the policy would return them: each text's ids, with their log-probs."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    async def answer(self, prompt, previous=None) -> Completion:
        self.prompts.append(list(prompt))
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Completion(prompt_ids=list(prompt), token_ids=ids, logprobs=[-0.5] * len(ids), text=text,
                          finish_reason="stop", policy_version=1)  # fmt: skip


def played(r: Rollouts, asks, game=play_game):
    """One game (or agent run) of `r` on seed 3 with the scripted answers `asks`; the rollouts closed after."""

    async def main():
        try:
            return await game(r, 3, "g", asks)
        finally:
            await r.close()

    return asyncio.run(main())


def test_a_game_calls_the_tools_and_earns_the_environments_reward(tmp_path, server, scripted):
    r = tool_rollouts(tmp_path, scripted, server.url)
    assert r.app.parse_action is parse_tool_call and r.app.reward is terminal_reward
    tokenizer = r.tokenizer
    asks = Scripted(tokenizer, [call("run_python", code="print(6*7)"), call("submit", code=SOLUTION)])

    result = played(r, asks)
    assert result.reward == 1.0 and not result.invalid and [a["tool_name"] for _, _, a in result.turns] == ["run_python", "submit"]
    def ids(messages, **kwargs):
        text = tokenizer.apply_chat_template(messages, tools=list(r.app.tools), tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    task = {"statement": "Write a Python function `remainder_ten(n)` that returns the remainder of n divided by 10.",
            "entry_point": "remainder_ten", "max_turns": 8}
    opening = [{"role": "system", "content": r.app.system_prompt}, {"role": "user", "content": r.app.render_prompt(task)}]
    assert asks.prompts[0] == ids(opening, add_generation_prompt=True)  # the tools and the task, by the template
    conversation = opening + [{"role": "assistant", "content": call("run_python", code="print(6*7)")},
                              {"role": "tool", "content": "exit code 0\nstdout:\n42\n\nstderr:\n"}]
    assert asks.prompts[1] == ids(conversation, add_generation_prompt=True)  # the tool's result as the template's tool turn
    (episode,) = result.episodes
    assert episode.tokens.tolist() == asks.prompts[1] + tokenizer(call("submit", code=SOLUTION), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_an_answer_without_a_tool_call_is_invalid_and_scored_alike_in_both_forms(tmp_path, server, scripted):
    r = tool_rollouts(tmp_path, scripted, server.url, "rollout.invalid_action_penalty=0.5")
    agent = tool_rollouts(tmp_path, scripted, server.url, "rollout.invalid_action_penalty=0.5", "app_module=apps.coder.tools_agent",
                          "chat.tool_parser=hermes")  # fmt: skip

    result = played(r, Scripted(r.tokenizer, ["HIT"]))
    assert result.invalid and result.reward == -0.5 and result.turns[0][2] is None
    assert played(agent, Scripted(r.tokenizer, ["HIT"]), Rollouts.play).reward == -0.5  # the agent form's (0 before)


def test_a_prompt_grown_past_max_model_len_cuts_the_game_off(tmp_path, server, scripted):
    """A tool's output grows the next prompt past generator.max_model_len (the first is 284 tokens): the game is cut
    off there, scored as one cut off at max_turns, its first turn trained; the policy is never asked with a prompt
    vLLM would refuse."""
    r = tool_rollouts(tmp_path, scripted, server.url, "generator.max_model_len=512", "rollout.cutoff_reward=-0.25")
    asks = Scripted(r.tokenizer, [call("run_python", code="print('x ' * 1000)"), call("submit", code=SOLUTION)])

    result = played(r, asks)
    assert result.overflowed and result.reward == -0.25 and len(asks.prompts) == 1 and len(result.turns) == 1
    (episode,) = result.episodes
    assert len(episode.tokens) < 512 and episode.reward == -0.25


def test_an_apps_reward_that_is_no_finite_number_loses_the_game_not_the_run(tmp_path, server, scripted):
    """An in-process app's reward (here NaN, a string, then raising) is checked: the game is lost with its reason,
    said once in the log; nothing reaches an episode (its group would be lost, counted: tests/test_agents.py)."""
    for reward, reason in [(math.nan, "reward_not_finite"), ("0.7", "reward_not_a_number"), (None, "ZeroDivisionError")]:
        r = tool_rollouts(tmp_path, scripted, server.url)
        r.app = dataclasses.replace(r.app, reward=lambda *_, value=reward: 1 / 0 if value is None else value)
        result = played(r, Scripted(r.tokenizer, [call("submit", code=SOLUTION)]), Rollouts.play)
        assert result.lost == reason and not result.episodes and r.reasons_said == {reason}


def test_a_template_without_a_tool_format_gets_the_tools_in_the_system_message(tmp_path, server):
    r = tool_rollouts(tmp_path, build_tiny_model(tmp_path / "tiny", seed=0), server.url)  # its template ignores tools=
    task = {"statement": "Add.", "entry_point": "f", "max_turns": 2}
    listed = "\n".join(json.dumps(spec) for spec in r.app.tools)
    assert '"name": "submit"' in listed and '"required": ["code"]' in listed
    system = f"{r.app.system_prompt}\n\n{HERMES_TOOLS.format(tools=listed)}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": r.app.render_prompt(task)}]
    text = r.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_ids(r.app, r.tokenizer, task, True) == r.tokenizer(text, add_special_tokens=False)["input_ids"]
    asked = [{"role": "system", "content": r.app.system_prompt}, {"role": "user", "content": r.app.render_prompt(task)}]
    assert Renderer(r.tokenizer).render(asked, list(r.app.tools), True) == text  # the chat server's (agent form), too


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_tiny_run_trains_through_the_tool_server(tmp_path, scripted):
    """`python -m forge_rl.grpo` on the scripted tiny policy, whose answers are often a run_python call: three
    steps against the tools server it launches. A game's tool call reaches the server and its output (42)
    is the next turn's prompt; what the trainer scores is what the policy sampled (ratio 1 at age 0)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "forge_rl.grpo", "--config", str(CONFIG), "app_module=apps.coder.tools_task",
            f"env.server={SERVER}", f"model.path={scripted}", f"run_dir={run_dir}", "sampling.constrained=false",
            "sampling.max_tokens=6", "grpo.group_size=4", "grpo.batch_size=2", "trainer.max_steps=3", "eval.interval=0",
            "rollout.num_workers=2", "env.max_concurrent=8", "trainer.checkpoint_every=0", "rollout.max_turns=3",
            "logging.samples_every=1"]  # fmt: skip
    out = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(abs(r["train/ratio_mean"] - 1.0) < 1e-4 for r in rows)
    games = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = [game["turns"] for game in games]
    called = [t for t in turns if t[0]["action"] and t[0]["action"]["tool_name"] == "run_python" and len(t) > 1]
    assert called, turns[:2]
    assert "42" in called[0][1]["prompt"]  # the tool's output, in the turn after the call


def test_an_agent_calls_the_tools_through_the_chat_server(tmp_path, server, scripted):
    """The agent form (apps/coder/tools_agent.py, an OpenAI-SDK agent): the server's tools reach it as
    ctx.tools, the policy's tool calls come back parsed by the chat server (hermes), each is a call_tool step,
    and the environment's grade is the reward. Its prompts are the environment form's, token for token, and
    the episode trains on exactly the ids sampled."""
    r = tool_rollouts(tmp_path, scripted, server.url, "app_module=apps.coder.tools_agent", "chat.tool_parser=hermes")
    assert r.app.is_agent and [t["function"]["name"] for t in r.app.tools] == ["run_python", "submit"]
    env_form = tool_rollouts(tmp_path, scripted, server.url)
    asks = Scripted(r.tokenizer, ["I will try. " + call("run_python", code="print(6*7)"), call("submit", code=SOLUTION)])

    result = played(r, asks, Rollouts.play)
    assert result.reward == 1.0
    task = {"statement": "Write a Python function `remainder_ten(n)` that returns the remainder of n divided by 10.",
            "entry_point": "remainder_ten", "max_turns": 8}
    assert asks.prompts[0] == prompt_ids(env_form.app, r.tokenizer, task, True)  # the same first prompt in both forms
    assert ":\n42\n" in r.tokenizer.decode(asks.prompts[1][len(asks.prompts[0]):])  # the tool's stdout, next turn
    (episode,) = result.episodes
    sampled = [r.tokenizer(text, add_special_tokens=False)["input_ids"] + [r.tokenizer.eos_token_id]
               for text in ("I will try. " + call("run_python", code="print(6*7)"), call("submit", code=SOLUTION))]
    assert episode.tokens.tolist() == asks.prompts[1] + sampled[1]
    assert episode.tokens[episode.loss_mask.bool()].tolist() == sampled[0] + sampled[1]


def test_an_agents_tool_call_with_arguments_that_are_not_an_object_is_answered_with_an_error(server):
    async def main():
        async with EnvSession(server.url, restore="none") as session:
            env = EnvRecorder(session)
            await env.reset(seed=3)
            bad = await env.call_tool("run_python", "[1, 2]")
            unparsable = await env.call_tool("run_python", "{code: 1")
            good = await env.call_tool("run_python", '{"code": "print(1)"}')
            return bad, unparsable, good, env.done

    bad, unparsable, good, done = asyncio.run(main())
    assert bad.startswith("error: the arguments of 'run_python' must be a JSON object") and "not JSON" in unparsable
    assert good.startswith("exit code 0\nstdout:\n1") and not done


def test_fenced_blocks_call_the_tools_for_a_model_without_a_tool_format(tmp_path, server, scripted):
    """apps/coder/tools_blocks_task.py (SmolLM2's tool app): a ```run block calls run_python, whose output is the
    next turn; a ```python block calls submit, whose grade is the reward; an answer without a block is invalid."""
    from apps.coder.tools_blocks_task import parse_action

    assert parse_action("text\n```run\nprint(1)\n```\n") == {"type": "call_tool", "tool_name": "run_python", "arguments": {"code": "print(1)\n"}}
    assert parse_action("```python\ndef f(): pass\n```\n")["tool_name"] == "submit" and parse_action("no block") is None
    r = tool_rollouts(tmp_path, scripted, server.url, "app_module=apps.coder.tools_blocks_task")
    asks = Scripted(r.tokenizer, ["Let me try.\n```run\nprint(6*7)\n```\n", f"```python\n{SOLUTION}```\n"])

    result = played(r, asks)
    assert [a["tool_name"] for _, _, a in result.turns] == ["run_python", "submit"] and result.reward == 1.0
    assert ":\n42\n" in r.tokenizer.decode(asks.prompts[1][len(asks.prompts[0]):])


def test_the_code_tool_apps_evaluation_counts_calls_of_listed_tools_and_code_run_before_submitting():
    """apps/coder/tools_task.py's eval_metrics: pass@1 and reward, the share of answers calling a listed tool (an unknown
    tool's call and no call count against it) and of episodes that ran code before their submission."""
    from apps.coder.tools_task import eval_metrics
    from forge_rl.rollout.play import GameResult

    run, submit, unknown = ({"type": "call_tool", "tool_name": n, "arguments": {"code": "1"}} for n in ("run_python", "submit", "nope"))
    results = [GameResult([], 1.0, False, turns=[([], "", run), ([], "", submit)]), GameResult([], 0.0, True, turns=[([], "", None)]),
               GameResult([], 0.5, False, turns=[([], "", unknown), ([], "", submit)])]  # fmt: skip
    assert eval_metrics(results, {}) == {"eval/pass_at_1": 1 / 3, "eval/reward": 0.5, "eval/call_rate": 3 / 5, "eval/ran_before_submit": 1 / 3}


def test_tool_choice_required_opens_every_answer_with_the_call_tag_given_in_the_prompt(tmp_path, server, scripted):
    """sampling.tool_choice 'required' (a model that never samples <tool_call> itself, Qwen2.5-Coder-0.5B): each turn's
    prompt ends with the tag, so the answer is the call's body, read as the call it completes; the tag is given, never
    sampled nor trained (the loss mask holds only what the policy sampled). Refused for an app not played by calls."""
    from forge_rl.core.config import ConfigError
    from forge_rl.recipes.grpo.check import check_run
    from forge_rl.rollout.tools import CALL_OPENING

    r = tool_rollouts(tmp_path, scripted, server.url, "sampling.tool_choice=required")
    bodies = [json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"
              for name, code in [("run_python", "print(6*7)"), ("submit", SOLUTION)]]  # fmt: skip
    asks = Scripted(r.tokenizer, bodies)
    result = played(r, asks)
    assert result.reward == 1.0 and [a["tool_name"] for _, _, a in result.turns] == ["run_python", "submit"]
    opening = r.tokenizer(CALL_OPENING, add_special_tokens=False)["input_ids"]
    assert [p[-len(opening):] for p in asks.prompts] == [opening, opening] and result.turns[0][1].startswith(CALL_OPENING)
    (episode,) = result.episodes
    sampled = [r.tokenizer(body, add_special_tokens=False)["input_ids"] + [r.tokenizer.eos_token_id] for body in bodies]
    assert episode.tokens[episode.loss_mask.bool()].tolist() == sampled[0] + sampled[1]
    with pytest.raises(ConfigError, match="sampling.tool_choice: 'required' opens answers"):
        check_run(load_config(CONFIG, ["sampling.tool_choice=required"]), this_host=False)
