"""env.dataset (issue #44): a dataset of prompts and an app's reward(prompt_row, answer), served by forge_rl's
dataset server (forge_rl/envs/dataset.py) with no server of the app's own. Its splits (a `split` field, a fixed
held-out fraction, a saved DatasetDict), the config check's one-line refusals, and the server over the wire
with apps/sums: the app's reward computed by the server, the row's answer never sent to the policy."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from forge_rl.core.app import load_app, terminal_reward
from forge_rl.core.config import ConfigError, load_config
from forge_rl.envs.local import launch_local
from forge_rl.envs.rows import DatasetError, load_splits, server_variables
from forge_rl.recipes.grpo.check import check_run
from forge_rl.rollout.env_client import EnvSession
from forge_rl.rollout.sessions import task_split_sizes

ROOT = Path(__file__).resolve().parent.parent
SUMS = ROOT / "configs" / "sums_smollm2_cpu.yaml"
DATA = ROOT / "apps" / "sums" / "sums.jsonl"


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_splits_come_from_the_rows_split_field_a_fixed_fraction_or_a_saved_dataset_dict(tmp_path):
    splits = load_splits(DATA)
    assert {k: len(v) for k, v in splits.items()} == {"train": 70, "test": 30}
    assert all(row["split"] == name for name, rows in splits.items() for row in rows)

    plain = jsonl(tmp_path / "plain.jsonl", [{"prompt": f"q{i}"} for i in range(20)])
    assert list(load_splits(plain)) == ["train"]
    held = load_splits(plain, 0.25)
    assert {k: len(v) for k, v in held.items()} == {"train": 15, "test": 5}
    assert held == load_splits(plain, 0.25)  # the same rows held out every time
    with pytest.raises(DatasetError, match="test_fraction"):
        load_splits(DATA, 0.25)  # its rows name their splits

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "answer": 1}]),
                          "validation": datasets.Dataset.from_list([{"prompt": "b", "answer": 2}])}).save_to_disk(str(saved))
    assert load_splits(saved) == {"train": [{"prompt": "a", "answer": 1}], "validation": [{"prompt": "b", "answer": 2}]}


def test_bad_input_stops_the_config_check_with_one_line_naming_the_key(tmp_path):
    def refused(*overrides) -> str:
        with pytest.raises(ConfigError) as info:
            check_run(load_config(SUMS, list(overrides)), this_host=False)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert refused(f"env.dataset={tmp_path / 'none.jsonl'}").startswith("env.dataset: ") and "no such file" in refused(f"env.dataset={tmp_path / 'none.jsonl'}")
    no_prompt = jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 1 + 1?", "answer": 2}, {"question": "What is 2 + 2?", "answer": 4}])
    assert refused(f"env.dataset={no_prompt}", "env.task_split=null", "eval.task_split=null").startswith("env.dataset: ")
    assert "row 1 of split 'train' has no text 'prompt' field" in refused(f"env.dataset={no_prompt}", "env.task_split=null", "eval.task_split=null")
    assert refused("eval.task_split=dev") == f"eval.task_split: 'dev' is not a split of apps/sums/sums.jsonl (it has: train, test)"
    assert refused("env.test_fraction=0.2").startswith("env.test_fraction: ")
    with pytest.raises(ConfigError, match="^env.reward_timeout_s: expected > 0, got 0.0 "):
        load_config(SUMS, ["env.reward_timeout_s=0"])
    assert refused("env.server=apps.blackjack.env:BlackJackEnvironment").startswith("env.server: env.dataset is served by")
    assert refused("app_module=apps.blackjack.natural").startswith("app_module 'apps.blackjack.natural': with env.dataset, reward(prompt_row, answer)")


def test_with_a_dataset_the_dataset_server_is_launched_and_the_run_scores_its_reward():
    cfg = load_config(SUMS, [])
    assert cfg.env.server == "forge_rl.envs.dataset:DatasetEnvironment" and cfg.env.url is None
    assert load_config(SUMS, ["env.url=http://sums:8000"]).env.server is None  # a deployed server instead
    app = check_run(cfg, this_host=False)
    assert app.reward is terminal_reward  # apps.sums.task.reward is the server's
    assert load_app("apps.sums.task").reward.__module__ == "apps.sums.task"


def test_the_dataset_server_serves_the_rows_and_computes_the_apps_reward():
    """apps/sums over the wire, as a run launches it: the Task API's splits, task i of a split is its i-th row,
    the observation is the row's prompt alone, and a step scores the answer with apps.sums.task.reward."""
    cfg = load_config(SUMS, [])
    splits = load_splits(DATA)

    async def play(url: str, split: str, index: int, answer: str) -> tuple[dict, dict]:
        async with EnvSession(url, timeout_s=30) as session:
            first = (await session.reset(seed=0, split=split, index=index)).observation
            return first, (await session.step({"answer": answer})).observation

    with launch_local(cfg.env.server, env=server_variables(cfg.env.dataset, cfg.app_module, 0.0, 10.0)) as server:
        assert task_split_sizes(server.url, cfg) == {"train": 70, "test": 30}
        row = splits["test"][3]
        first, right = asyncio.run(play(server.url, "test", 3, str(row["answer"])))
        _, wrong = asyncio.run(play(server.url, "test", 3, str(row["answer"] + 1)))
    assert first["prompt"] == row["prompt"] and not first["done"] and "answer" not in first
    assert (right["done"], right["reward"]) == (True, 1.0) and (wrong["done"], wrong["reward"]) == (True, 0.0)
