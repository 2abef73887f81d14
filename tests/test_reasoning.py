"""Reasoning-gym tasks (apps/reasoning): the app's parsing of free-text answers, its config, and its server
launched as a run launches it, over the wire: the Task API's splits, the question without its answer, and
the family's verifier scoring an answer computed here from the question alone."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from apps.reasoning import task
from forge_rl.core.app import terminal_reward
from forge_rl.core.config import load_config
from forge_rl.envs.local import launch_local
from forge_rl.recipes.grpo.check import check_run
from forge_rl.rollout.env_client import EnvSession
from forge_rl.rollout.sessions import task_split_sizes

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "reasoning_smollm2_cpu.yaml"


@pytest.mark.parametrize("text, answer", [
    ("84 - 11 = 73", "73"),
    ("The answer is -4.", "-4"),
    ("It is 2.5 apples", "2.5"),
    ("1,024 legs in total", "1024"),
    ("<answer> 12 </answer> (I counted 3 times)", "12"),
    ("<answer>No</answer>", "No"),
    ("<answer></answer> so 7", "7"),
])  # fmt: skip
def test_the_answer_is_the_tagged_text_else_the_last_number(text, answer):
    assert task.parse_action(text) == {"answer": answer}


def test_an_answer_with_no_number_is_invalid():
    assert task.parse_action("I cannot count legs.") is None and task.parse_action("") is None


def test_the_config_checks_and_its_evaluation_reports_accuracy_first():
    cfg = load_config(CONFIG, [])
    app = check_run(cfg, this_host=False)
    assert cfg.env.server == "apps.reasoning.env:ReasoningEnvironment"
    assert (cfg.env.task_split, cfg.eval.task_split, cfg.sampling.constrained) == ("train", "test", False)
    assert app.render_prompt(task.SAMPLE_OBSERVATION) == task.SAMPLE_OBSERVATION["question"]

    class Result:
        def __init__(self, reward, invalid=False):
            self.reward, self.invalid = reward, invalid

    metrics = app.eval_metrics([Result(1.0), Result(0.5), Result(0.0, invalid=True), Result(0.0)], {})
    assert list(metrics)[0] == "eval/accuracy" and metrics == {"eval/accuracy": 0.25, "eval/score": 0.375, "eval/invalid": 0.25}


def test_the_launched_server_serves_its_splits_and_scores_with_the_familys_verifier():
    """The config's server and family over the wire: a test task's question, its sum computed here from the
    question's text (not from the server), right and wrong answers scored by chain_sum's verifier."""
    cfg = load_config(CONFIG, [])

    async def play(url: str, index: int, reply) -> tuple[dict, dict]:
        async with EnvSession(url, timeout_s=60) as session:
            first = (await session.reset(seed=0, split="test", index=index, **cfg.env.reset_args)).observation
            action = task.parse_action(reply(first["question"]))
            return first, (await session.step(action)).observation

    def total(question: str) -> int:
        expression = re.fullmatch(r"State the final answer to the following arithmetic problem: ([\d +-]+) =", question)[1]
        return sum(int(sign + n) for sign, n in re.findall(r"([+-]?)\s*(\d+)", expression))

    with launch_local(cfg.env.server, timeout_s=180) as server:
        assert task_split_sizes(server.url, cfg) == {"train": 5000, "test": 500}
        first, scored = asyncio.run(play(server.url, 7, lambda q: f"It is {total(q)}."))
        _, wrong = asyncio.run(play(server.url, 7, lambda q: f"It is {total(q) + 1}."))
        _, near = asyncio.run(play(server.url, 7, lambda q: f"It is {total(q)}5."))  # holds the answer: partial credit
    assert not first["done"] and set(first) >= {"question", "family"} and "answer" not in first
    assert first["family"] == cfg.env.reset_args["family"]
    assert terminal_reward(scored, False, 0.0) == 1.0 and terminal_reward(wrong, False, 0.0) == 0.0
    assert 0.0 < near["reward"] < 1.0  # chain_sum's verifier: len(answer) / len(text) when the text contains it
