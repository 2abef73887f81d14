"""The code app's task module against the tiny model's tokenizer and the server's task generator (run in the
servers' virtualenv, tests/server_venv.py; no actors): prompts without unknown words, one token per answer
word, answers parsed per turn."""

import pytest

from apps.coder import task
from forge_rl.core.app import load_app
from forge_rl.rollout.play import GameResult, answer_token_ids, prompt_ids
from forge_rl.models.tiny import build_tiny_model
from tests.server_venv import synth_tasks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def synth_task(seed, family=1):
    """Seeds 0-299 of a family, fetched from the server's code at once (one process for all)."""
    return synth_tasks(tuple(range(300)), family)[seed]


def observation(seed, family=1, **fields):
    t = synth_task(seed, family)
    return {"task_set": "synth", "task_id": t.task_id, "examples": t.examples, "turn": 0, "max_turns": 1, **fields}


@pytest.mark.parametrize("family", [1, 2])
def test_synth_prompts_are_whole_tokens_of_the_tiny_model(tokenizer, family):
    for seed in range(300):
        ids = prompt_ids(task, tokenizer, observation(seed, family), first_turn=True)
        assert tokenizer.unk_token_id not in ids, task.render_prompt(observation(seed, family))
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
            [{"role": "user", "content": task.render_prompt(observation(seed, family))}], tokenize=False, add_generation_prompt=True
        )


def test_answer_vocabulary_is_one_token_per_word_and_blackjack_keeps_its_two(tokenizer):
    ids = answer_token_ids(load_app("apps.coder.task"), tokenizer)
    assert len(set(ids)) == len(task.ANSWER_VOCABULARY) == 14
    assert tokenizer.decode(ids[:1] + ids[3:4] + ids[11:12]) == "x*7", "answers decode by concatenation"
    assert [tokenizer.decode([i]) for i in answer_token_ids(load_app("apps.blackjack.task"), tokenizer)] == ["HIT", "STAND"]


def test_parse_action_per_task_set_and_turn():
    assert task.parse_action(" x*7\n", observation(0)) == {"code": "x*7", "submit": True}
    assert task.parse_action("  ", observation(0)) is None
    he = {"task_set": "humaneval", "turn": 0, "max_turns": 3}
    answer = "Let me test.\n```run\nprint(f(2))\n```\nthen\n```python\ndef f(x):\n    return x\n```"
    assert task.parse_action(answer, he) == {"code": "def f(x):\n    return x\n", "submit": True}
    assert task.parse_action("```run\nprint(1)\n```", he) == {"code": "print(1)\n", "submit": False}
    assert task.parse_action("no block here", he) == {"code": "no block here", "submit": False}
    assert task.parse_action("```run\nprint(1)\n```", {**he, "turn": 2}) == {"code": "print(1)\n", "submit": True}


def test_synthesizer_and_eval_metrics():
    assert all(task.synthesize(synth_task(s).examples) for s in range(200))
    assert task.synthesizer({"task_set": "humaneval"}) is None
    obs = observation(3)
    assert task.synthesizer(obs) == "x+7" and task.synthesize(synth_task(3, 2).examples, 2) is not None
    results = [GameResult([], 1.0, False), GameResult([], 0.5, False), GameResult([], -1.0, True)]
    assert task.eval_metrics(results, {}) == {"eval/pass_at_1": 1 / 3, "eval/pass_rate": 0.5, "eval/invalid_rate": 1 / 3, "eval/tasks": 3}
    # a submission that is not a function to test (the server's verdict) counts as invalid, a wrong function does not
    results = [GameResult([], 0.0, False, observation={"verdict": v}) for v in ("no_function", "syntax_error", "failed", "passed")]
    assert task.eval_metrics(results, {})["eval/invalid_rate"] == 0.5
