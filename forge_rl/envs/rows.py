"""A dataset's rows and splits, for `env.dataset`: a JSONL file (one JSON object per line) or an HF `datasets`
directory (`save_to_disk`). Read by the config check in the training virtualenv and by the dataset server
(dataset.py) in the servers' one; free of openenv. Every row has a text `prompt` field; the rest is the
app's (an expected answer, an id), given to its reward(prompt_row, answer) and never to the policy.

The splits, first that applies: a saved DatasetDict's own; the rows' `split` field, when every row has one;
env.test_fraction > 0: that share of the rows (chosen by a fixed shuffle, so every run holds out the same
rows) as "test" and the rest as "train"; else one split, "train".
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_FIELD = "prompt"
SPLIT_FIELD = "split"
# How a run tells the server it launches what to serve (dataset.py reads them); a server deployed on its own
# (Kubernetes) is given the same variables.
VARIABLES = {"dataset": "FORGE_RL_DATASET", "app_module": "FORGE_RL_DATASET_APP", "test_fraction": "FORGE_RL_DATASET_TEST_FRACTION",
             "reward_timeout_s": "FORGE_RL_DATASET_REWARD_TIMEOUT_S"}


class DatasetError(ValueError):
    """The dataset cannot be served; one line naming the file, the row or the field."""


def read_rows(path: str | Path) -> list[dict] | dict[str, list[dict]]:
    """The rows of a JSONL file, or of a saved HF dataset (a DatasetDict: {split: rows})."""
    path = Path(path)
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise DatasetError(f"{path} is a directory, read as an HF dataset, but the `datasets` package is not installed") from None
        try:
            saved = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DatasetError(f"{path}: not a dataset saved with save_to_disk ({str(e).splitlines()[0]})") from None
        if isinstance(saved, datasets.DatasetDict):
            return {name: saved[name].to_list() for name in saved}
        return saved.to_list()
    if not path.is_file():
        raise DatasetError(f"{path}: no such file or directory")
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}, line {number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}, line {number}: a row must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def load_splits(path: str | Path, test_fraction: float = 0.0) -> dict[str, list[dict]]:
    """{split: its rows, in the file's order}, as the module docstring says; DatasetError if a row has no
    text prompt, a split is empty, or test_fraction cannot apply."""
    if not 0 <= test_fraction < 1:
        raise DatasetError(f"test_fraction: expected 0 <= fraction < 1, got {test_fraction}")
    rows = read_rows(path)
    named = isinstance(rows, dict) or (rows and all(SPLIT_FIELD in row for row in rows))
    if named and test_fraction > 0:
        raise DatasetError(f"{path}: its rows name their splits; test_fraction holds out rows of a dataset without them only")
    if isinstance(rows, dict):
        splits = rows
    elif named:
        splits = {}
        for row in rows:
            splits.setdefault(str(row[SPLIT_FIELD]), []).append(row)
    elif test_fraction > 0:
        order = list(range(len(rows)))
        random.Random(0).shuffle(order)
        held_out = set(order[: max(1, round(len(rows) * test_fraction))])
        splits = {"train": [r for i, r in enumerate(rows) if i not in held_out], "test": [r for i, r in enumerate(rows) if i in held_out]}
    else:
        splits = {"train": rows}
    for name, split_rows in splits.items():
        if not split_rows:
            raise DatasetError(f"{path}: split {name!r} has no rows")
        for index, row in enumerate(split_rows):
            if not isinstance(row.get(PROMPT_FIELD), str):
                raise DatasetError(f"{path}: row {index} of split {name!r} has no text {PROMPT_FIELD!r} field: {str(row)[:120]}")
    return splits


def server_variables(dataset: str, app_module: str, test_fraction: float, reward_timeout_s: float) -> dict[str, str]:
    """The environment variables that make the dataset server serve `dataset` with `app_module`'s reward."""
    return {VARIABLES["dataset"]: str(Path(dataset).resolve()), VARIABLES["app_module"]: app_module,
            VARIABLES["test_fraction"]: repr(float(test_fraction)), VARIABLES["reward_timeout_s"]: repr(float(reward_timeout_s))}
