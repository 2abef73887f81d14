"""Evaluation with pass@k and several splits (issue #45): the unbiased pass@k estimator against hand-computed
cases and the exact binomial formula, and a real evaluation (the tiny model in a vLLM generator service, the
dataset server of env.dataset on two evaluation splits) whose figures are read back from its games' rewards."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forge_rl.core.app import load_app
from forge_rl.core.config import GeneratorConfig, load_config
from forge_rl.engines.vllm.generator import Generator
from forge_rl.envs.local import launch_local
from forge_rl.envs.rows import server_variables
from forge_rl.models.tiny import build_tiny_model
from forge_rl.rollout.evaluation import Evaluation, pass_at_k, pass_figures
from forge_rl.rollout.play import answer_token_ids
from forge_rl.rollout.rollouts import Rollouts
from forge_rl.rollout.sessions import task_split_sizes
from forge_rl.weights import control

pytestmark = pytest.mark.timeout(600)
TINY = Path(__file__).resolve().parent.parent / "configs" / "blackjack_tiny_cpu.yaml"


def exact(n: int, c: int, k: int) -> float:
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_is_chen_et_als_unbiased_estimator():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the share of samples that pass
    assert pass_at_k(5, 2, 5) == 1.0 and pass_at_k(5, 1, 5) == 1.0  # k = n: any pass among the n
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # none passes
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 3) == 1.0  # all pass
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    for n, c, k in [(10, 3, 4), (20, 1, 5), (200, 17, 10), (8, 7, 2), (100, 50, 100)]:
        assert pass_at_k(n, c, k) == pytest.approx(exact(n, c, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)  # k > n
    # over tasks: their mean; a task whose samples were aborted below k counts only for smaller k
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0]]
    figures = pass_figures(rewards, [1, 2, 4], pass_reward=1.0)
    assert figures == pytest.approx({"eval/sampled_pass_at_1": (0.25 + 0 + 1) / 3, "eval/sampled_pass_at_2": (0.5 + 0 + 1) / 3, "eval/sampled_pass_at_4": 0.5})
    assert pass_figures([[0.4, 0.5]], [1], pass_reward=0.5) == {"eval/sampled_pass_at_1": 0.5}  # passes at >= pass_reward


# The eval split's task 0 has no right answer (neither yes nor no), the extra split's none at all: sampled games
# played on other tasks (another split, a drawn index) would pass there.
ROWS = [("is the sun yellow", "yes", "train"), ("is the moon green", "no", "train"),
        ("is the sky blue", "maybe", "eval"), ("is the cat big", "yes", "eval"), ("is the dog red", "no", "eval"),
        *[(f"is the {w} small", "maybe", "extra") for w in ("bird", "fish", "tree", "house", "star")]]
GAMES, SAMPLES = 4, 6


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Two evaluations of the same weights, each with greedy and sampled games on the eval and extra splits."""
    tmp = tmp_path_factory.mktemp("eval")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p + "? Answer yes or no.", "answer": a, "split": s}) + "\n" for p, a, s in ROWS))
    cfg = load_config(TINY, [
        "app_module=tests.yes_no_app", "env.server=null", f"env.dataset={data}", "env.max_concurrent=64",
        "eval.task_split=[eval,extra]", f"eval.num_games={GAMES}", f"eval.samples={SAMPLES}", "eval.pass_k=[1,3,6]",
    ])
    app = load_app(cfg.app_module, cfg.sampling.constrained, dataset=True)
    model = build_tiny_model(tmp / "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)

    async def main(url):
        await control.start()
        policy = await Generator.options(num_replicas=1).as_service(str(model), "float32", GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01))
        rollouts = Rollouts(cfg, app, tokenizer, policy, url, answer_token_ids(app, tokenizer))
        rollouts.num_tasks = task_split_sizes(url, cfg)
        try:
            evaluation = Evaluation(rollouts)
            first = await evaluation()
            rewards = dict(evaluation.sampled_rewards)
            return evaluation, first, rewards, await evaluation()
        finally:
            await rollouts.close()
            await policy.stop()  # a service stops itself; runtime.actor.stop is for actors
            await control.stop()

    with launch_local(cfg.env.server, env=server_variables(str(data), cfg.app_module, 0.0, 10.0), max_concurrent_envs=64) as server:
        return asyncio.run(main(server.url))


def test_an_evaluation_reports_each_splits_greedy_figures_and_pass_at_k_of_its_sampled_games(evaluated):
    evaluation, values, rewards, again = evaluated
    # the first split's figures as eval/..., headline (the app's) first; the other's as eval/extra/...
    assert list(values) == ["eval/reward", "eval/games", "eval/sampled_pass_at_1", "eval/sampled_pass_at_3", "eval/sampled_pass_at_6",
                            "eval/extra/reward", "eval/extra/games", "eval/extra/sampled_pass_at_1", "eval/extra/sampled_pass_at_3", "eval/extra/sampled_pass_at_6"]
    assert values["eval/games"] == 3 and values["eval/extra/games"] == GAMES  # min(num_games, the split's tasks)
    # the greedy figure is the mean of the greedy games' rewards (all 3 are the evaluation's samples)
    assert values["eval/reward"] == pytest.approx(sum(s["reward"] for s in evaluation.samples) / 3)
    assert all(len(s["turns"]) == 1 for s in evaluation.samples)

    assert [len(t) for t in rewards["eval"]] == [SAMPLES] * 3 and [len(t) for t in rewards["extra"]] == [SAMPLES] * GAMES
    assert rewards["eval"][0] == [0.0] * SAMPLES and all(r == [0.0] * SAMPLES for r in rewards["extra"])  # each on its own task
    tasks_1_2 = rewards["eval"][1] + rewards["eval"][2]
    assert 0 < sum(tasks_1_2) < 2 * SAMPLES, "the random policy at temperature 1 answers both ways"
    for k in (1, 3, 6):
        expected = sum(exact(SAMPLES, int(sum(task)), k) for task in rewards["eval"]) / 3
        assert values[f"eval/sampled_pass_at_{k}"] == pytest.approx(expected)
        assert values[f"eval/extra/sampled_pass_at_{k}"] == 0.0
    assert values["eval/sampled_pass_at_1"] == pytest.approx(sum(tasks_1_2) / (3 * SAMPLES))  # pass@1: the share that passed
    assert values["eval/sampled_pass_at_1"] <= values["eval/sampled_pass_at_3"] <= values["eval/sampled_pass_at_6"]
    assert again == values, "the sampled games are seeded: the same weights give the same figures"
