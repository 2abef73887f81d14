"""The dataset server's class in-process, in the servers' virtualenv (openenv, datasets): a saved HF
DatasetDict served with its own splits, a seeded reset drawing a training row, the app's reward computed here."""

import json

import pytest

from forge_rl.envs import dataset
from forge_rl.envs.rows import VARIABLES


@pytest.fixture
def serve(monkeypatch):
    def serve(path, app_module="apps.sums.task", test_fraction=0.0, reward_timeout_s=10.0):
        for key, value in (("dataset", path), ("app_module", app_module), ("test_fraction", test_fraction), ("reward_timeout_s", reward_timeout_s)):
            monkeypatch.setenv(VARIABLES[key], str(value))
        dataset.served.cache_clear()
        return dataset.DatasetEnvironment()
    yield serve
    dataset.served.cache_clear()


def test_a_saved_dataset_dict_is_served_with_its_splits_and_scored_by_the_apps_reward(serve, tmp_path):
    import datasets

    rows = [{"prompt": f"What is {a} + 1?", "answer": a + 1} for a in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]), "validation": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "saved"))
    env = serve(tmp_path / "saved")
    assert env.list_splits() == ["train", "validation"] and env.num_tasks("validation") == 1
    assert env.reset(split="validation", index=0).prompt == "What is 4 + 1?"
    assert (done := env.step(dataset.DatasetAction(answer="5"))).done and done.reward == 1.0
    assert dataset.DatasetEnvironment.health_info()["splits"] == {"train": 4, "validation": 1}


def test_a_reset_without_a_split_draws_a_training_row_from_its_seed(serve, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(20)))
    env = serve(path, test_fraction=0.25)
    assert env.list_splits() == ["train", "test"]
    train = {row["prompt"] for row in dataset.served()[0]["train"]}
    drawn = [env.reset(seed=s).prompt for s in range(10)]
    assert set(drawn) <= train and drawn == [env.reset(seed=s).prompt for s in range(10)] and len(set(drawn)) > 1
    with pytest.raises(ValueError, match="no split 'dev'"):
        env.reset(split="dev", index=0)
    with pytest.raises(ValueError, match="tasks 0 to 4"):
        env.reset(split="test", index=5)
