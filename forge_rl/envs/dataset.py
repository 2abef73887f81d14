"""The dataset server: a dataset of prompts and an app's reward function as a single-turn OpenEnv environment,
so that a task needs no server of its own (`env.dataset`, docs/adding_an_environment.md).

    observation  the row's `prompt` text (DatasetObservation.prompt); the app's render_prompt makes the turn
    action       the answer text the app's parse_action made ({"answer": ...})
    reward       the app module's reward(prompt_row, answer), computed here, once; the episode is done. A reward
                 that is no finite number, or a function that raises or outlasts env.reward_timeout_s, is this
                 step's error (core/rewards.py RewardError, its reason first in the message the client reads)

Task API: the dataset's splits (rows.py), task i of a split is its i-th row; a reset without a split draws a
row of "train" (of the only split, if there is one) from the seed. What to serve comes from the variables of
rows.VARIABLES, which a run sets when it launches this server on 127.0.0.1; the app module must import here
(the repository, and the folder holding it, on PYTHONPATH), with what this virtualenv has.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import os
import random
import threading
from collections.abc import Callable
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from forge_rl.core.rewards import RewardError, checked_reward
from forge_rl.envs.rows import PROMPT_FIELD, VARIABLES, load_splits


class DatasetAction(Action):
    answer: str = Field(description="the policy's answer, as the app's parse_action made it")


class DatasetObservation(Observation):  # Observation brings done, reward and metadata
    prompt: str = Field("", description="the row's prompt")


class DatasetState(State):  # State brings episode_id and step_count
    split: str = ""
    index: int = 0


@functools.cache
def served() -> tuple[dict[str, list[dict]], Callable[[dict, str], float]]:
    """(the splits, the app's reward as `score` calls it), read once per server process from rows.VARIABLES."""
    missing = [name for name in VARIABLES.values() if name not in os.environ]
    if missing:
        raise RuntimeError(f"the dataset server needs {', '.join(missing)} (a run with env.dataset sets them)")
    splits = load_splits(os.environ[VARIABLES["dataset"]], float(os.environ[VARIABLES["test_fraction"]]))
    module, timeout_s = os.environ[VARIABLES["app_module"]], float(os.environ[VARIABLES["reward_timeout_s"]])
    return splits, functools.partial(score, importlib.import_module(module).reward, f"{module}.reward", timeout_s)


class DatasetEnvironment(Environment[DatasetAction, DatasetObservation, DatasetState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # sessions share only the rows, which nothing writes

    def __init__(self) -> None:
        super().__init__()
        self._splits, self._reward = served()
        self._state = DatasetState()

    @classmethod
    def health_info(cls) -> dict:
        splits, _ = served()  # a server that cannot read its dataset fails at start, not at the first reset
        return {"dataset": os.environ[VARIABLES["dataset"]], "splits": {name: len(rows) for name, rows in splits.items()}}

    def list_splits(self) -> list[str]:
        return list(self._splits)

    def num_tasks(self, split: str) -> int:
        return len(self._rows(split))

    def get_task(self, split: str, index: int) -> dict:
        return {"id": f"{split}-{index}"}  # never the row: it may hold the answer

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, split: Optional[str] = None,
              index: Optional[int] = None, **kwargs: Any) -> DatasetObservation:
        if split is None:
            split = "train" if "train" in self._splits or len(self._splits) != 1 else next(iter(self._splits))
            index = random.Random(seed).randrange(len(self._rows(split)))
        rows = self._rows(split)
        if index is None or not 0 <= index < len(rows):
            raise ValueError(f"split {split!r} has tasks 0 to {len(rows) - 1}, not {index}")
        self._state = DatasetState(episode_id=episode_id, split=split, index=index)
        return DatasetObservation(prompt=rows[index][PROMPT_FIELD])

    def step(self, action: DatasetAction, timeout_s: Optional[float] = None, **kwargs: Any) -> DatasetObservation:
        s = self._state
        s.step_count += 1
        row = self._rows(s.split)[s.index]
        return DatasetObservation(prompt=row[PROMPT_FIELD], done=True, reward=self._reward(row, action.answer))

    def _rows(self, split: str) -> list[dict]:
        if split not in self._splits:
            raise ValueError(f"no split {split!r} (the dataset has: {', '.join(self._splits)})")
        return self._splits[split]

    @property
    def state(self) -> DatasetState:
        return self._state


def score(reward: Callable[[dict, str], float], name: str, timeout_s: float, row: dict, answer: str) -> float:
    """reward(row, answer) on a thread of its own, waited for timeout_s (env.reward_timeout_s) at most, and checked.
    Python cannot stop a thread: a hung reward function is left to end by itself, holding its thread, not the session."""
    result = concurrent.futures.Future()

    def run():
        try:
            result.set_result(reward(row, answer))
        except BaseException as e:
            result.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    try:
        value = result.result(timeout_s)
    except Exception as e:
        if not result.done():
            raise RewardError("reward_timeout", f"{name} took longer than env.reward_timeout_s={timeout_s:g} s") from None
        raise RewardError("reward_raised", f"{name} raised {type(e).__name__}: {e}"[:300]) from None
    return checked_reward(value, name)
