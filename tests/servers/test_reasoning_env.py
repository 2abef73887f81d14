"""The reasoning-gym server's class in-process, in the servers' virtualenv (openenv, reasoning-gym): the Task
API's splits, train and test disjoint, the question shown without its answer, the family's verifier scoring."""

import json
import re

import pytest

from apps.reasoning import env

FAMILY = {"family": "chain_sum", "family_args": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}  # 200 questions


def answer_of(server: env.ReasoningEnvironment, family_args: dict) -> str:
    """The generator's answer to the task a reset just dealt (kept in the server, never sent)."""
    s = server.state
    _, splits = env._tasks(s.family, json.dumps(family_args, sort_keys=True))
    return splits[s.split][s.index]["answer"]


def test_the_task_api_serves_train_and_test_with_fixed_sizes_and_refuses_other_splits():
    server = env.ReasoningEnvironment()
    assert server.list_splits() == ["train", "test"]
    assert (server.num_tasks("train"), server.num_tasks("test")) == (env.TRAIN_SIZE, env.TEST_SIZE)
    assert server.get_task("test", 3) == {"id": "test-3"}
    with pytest.raises(ValueError, match="no split 'dev'"):
        server.num_tasks("dev")
    with pytest.raises(ValueError, match="no split 'validation'"):
        server.reset(split="validation", index=0, **FAMILY)
    with pytest.raises(ValueError, match="tasks 0 to 499"):
        server.reset(split="test", index=env.TEST_SIZE, **FAMILY)
    with pytest.raises(ValueError, match="family 'no_such_family'"):
        server.reset(split="test", index=0, family="no_such_family")


def test_no_held_out_question_is_a_training_task_even_in_a_family_of_200_questions():
    server = env.ReasoningEnvironment()
    questions = {split: {server.reset(split=split, index=i, **FAMILY).question for i in range(server.num_tasks(split))}
                 for split in ("train", "test")}  # fmt: skip
    assert len(questions["test"]) >= 10 and len(questions["train"]) >= 150
    # the generator's options reached it: two one-digit terms ("...problem: 4 - 1 =")
    assert all(re.fullmatch(r".*: \d [+-] \d =", q) for q in questions["train"] | questions["test"])
    assert not questions["train"] & questions["test"]
    # a reset without a split is a training task drawn from the seed
    drawn = [server.reset(seed=s, **FAMILY).question for s in range(20)]
    assert set(drawn) <= questions["train"] and drawn == [server.reset(seed=s, **FAMILY).question for s in range(20)]


def test_the_observation_is_the_question_and_never_its_answer():
    server = env.ReasoningEnvironment()
    for i in range(30):
        observation = server.reset(split="test", index=i, family="leg_counting")
        answer = answer_of(server, {})
        assert "how many legs" in observation.question and observation.reward is None and not observation.done
        assert answer not in observation.model_dump_json(exclude={"question"}) and f" {answer}" not in observation.question


def test_the_reward_is_the_familys_verifier_score_one_answer_per_episode():
    server = env.ReasoningEnvironment()
    server.reset(split="test", index=0, **FAMILY)
    right = answer_of(server, FAMILY["family_args"])
    done = server.step(env.ReasoningAction(answer=right))
    assert done.done and done.reward == 1.0
    again = server.step(env.ReasoningAction(answer=right))
    assert again.error and again.reward is None  # one answer per episode
    server.reset(split="test", index=0, **FAMILY)
    assert server.step(env.ReasoningAction(answer=str(int(right) + 1))).reward == 0.0
    server.reset(split="test", index=0, **FAMILY)
    assert server.step(env.ReasoningAction(answer=f"+0{right}.0" if int(right) >= 0 else f"{right}.00")).reward == 1.0  # chain_sum's verifier reads numbers
    assert env.ReasoningEnvironment().step(env.ReasoningAction(answer="1")).error == "no task: call reset first"


def test_the_servers_default_family_comes_from_its_option(monkeypatch):
    monkeypatch.setenv("REASONING_FAMILY", "basic_arithmetic")
    monkeypatch.setenv("REASONING_FAMILY_ARGS", '{"max_terms": 2}')
    assert env.ReasoningEnvironment.health_info()["family"] == "basic_arithmetic"
    observation = env.ReasoningEnvironment().reset(split="train", index=0)
    assert observation.family == "basic_arithmetic" and observation.question.startswith("Calculate")
