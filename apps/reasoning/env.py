"""Reasoning tasks from reasoning-gym (procedural generators, each with its own verifier) as an OpenEnv server.

One family at a time (`family`: a reasoning-gym dataset name such as chain_sum, basic_arithmetic or
leg_counting; `family_args`: its generator's options, e.g. {"max_terms": 2}). The server's default is
`--family` / `--family-args` (REASONING_FAMILY, REASONING_FAMILY_ARGS as JSON); a config picks its own with
env.reset_args, which reach every reset.

    observation  the generated question (ReasoningObservation.question); never its answer nor its metadata
    action       the answer text ({"answer": "-4"}), as the app's parse_action made it
    reward       the family's own verifier, `dataset.score_answer(answer, entry)`: 1.0 for the answer,
                 partial credit where the family gives it; the episode is done after one answer

Task API: splits "train" (TRAIN_SIZE tasks) and "test" (TEST_SIZE), the same sizes for every family. They
are drawn from disjoint seed ranges of the generator (task i of train: seeds from TRAIN_SEED on, of test:
from TEST_SEED on) and are disjoint in questions too: a question whose hash falls in the held-out tenth
(`held_out`) is only ever in "test", any other only in "train", so no held-out question is trained on even
in a family with few distinct questions (such a family's test split repeats its held-out questions). A
reset without a split draws a train task from the seed.

    python -m apps.reasoning.env --port 8000 --family chain_sum --family-args '{"max_terms": 2}'
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sys
from typing import Any, Optional

import reasoning_gym
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

SPLITS = ("train", "test")
TRAIN_SIZE, TEST_SIZE = 5000, 500
TRAIN_SEED, TEST_SEED = 0, 1_000_000_000  # reasoning-gym's task i of seed s is its generator's Random(s + i)
DRAWS = 100  # a split's tasks are found in the first DRAWS times its size of its seeds (ranges disjoint)
MAX_ANSWER_CHARS = 1000


class ReasoningAction(Action):
    answer: str = Field(max_length=MAX_ANSWER_CHARS, description="the answer, scored by the family's verifier")


class ReasoningObservation(Observation):  # Observation brings done, reward and metadata
    family: str = ""
    question: str = Field("", description="the task's question, as the generator wrote it")
    error: Optional[str] = Field(None, description="why the last action was refused, if it was")


class ReasoningState(State):  # State brings episode_id and step_count
    family: str = ""
    split: str = ""
    index: int = 0


def held_out(question: str) -> bool:
    """Whether a question belongs to the test split: a tenth of all questions, by a hash of its text."""
    return hashlib.sha256(question.encode()).digest()[0] % 10 == 0


def default_family() -> tuple[str, dict]:
    return os.environ.get("REASONING_FAMILY", "chain_sum"), json.loads(os.environ.get("REASONING_FAMILY_ARGS") or "{}")


@functools.lru_cache(maxsize=8)
def _tasks(family: str, family_args: str) -> tuple[Any, dict[str, list[dict]]]:
    """(the generator, {split: its entries}) of a family and its options (as JSON, to be hashable)."""
    args = json.loads(family_args)
    try:
        train = reasoning_gym.create_dataset(family, seed=TRAIN_SEED, size=DRAWS * TRAIN_SIZE, **args)
        test = reasoning_gym.create_dataset(family, seed=TEST_SEED, size=DRAWS * TEST_SIZE, **args)
    except (ValueError, TypeError, AssertionError) as e:  # an unknown name or option: the reset says which
        raise ValueError(f"reasoning-gym family {family!r} with {args}: {e or type(e).__name__}") from None
    splits = {"train": _first(train, TRAIN_SIZE, keep=False), "test": _first(test, TEST_SIZE, keep=True)}
    return train, splits


def _first(dataset, n: int, keep: bool) -> list[dict]:
    """The first n entries of `dataset` whose question is held out (keep=True) or not (keep=False)."""
    entries, i = [], 0
    while len(entries) < n:
        if i >= len(dataset):
            raise ValueError(f"{n} {'held-out' if keep else 'training'} questions not found in {i} draws of this family")
        entry = dataset[i]
        if held_out(entry["question"]) == keep:
            entries.append(entry)
        i += 1
    return entries


class ReasoningEnvironment(Environment[ReasoningAction, ReasoningObservation, ReasoningState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # sessions share only the generated tasks, which nothing writes

    def __init__(self) -> None:
        super().__init__()
        self._state = ReasoningState()
        self._entry: dict | None = None
        self._verifier: Any = None

    @classmethod
    def health_info(cls) -> dict:
        family, args = default_family()
        _tasks(family, json.dumps(args, sort_keys=True))  # a bad default family fails the start, not a reset
        return {"family": family, "family_args": args, "splits": {"train": TRAIN_SIZE, "test": TEST_SIZE}}

    def list_splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        return {"train": TRAIN_SIZE, "test": TEST_SIZE}[_split(split)]

    def get_task(self, split: str, index: int) -> dict:
        return {"id": f"{_split(split)}-{index}"}  # never the entry: it holds the answer

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, split: Optional[str] = None,
              index: Optional[int] = None, family: Optional[str] = None, family_args: Optional[dict] = None,
              **kwargs: Any) -> ReasoningObservation:
        default, default_args = default_family()
        family, args = family or default, default_args if family_args is None else dict(family_args)
        if split is None:
            split, index = "train", random.Random(seed).randrange(TRAIN_SIZE)
        size = self.num_tasks(split)
        if index is None or not 0 <= index < size:
            raise ValueError(f"split {split!r} has tasks 0 to {size - 1}, not {index}")
        self._verifier, splits = _tasks(family, json.dumps(args, sort_keys=True))
        self._entry = splits[split][index]
        self._state = ReasoningState(episode_id=episode_id, family=family, split=split, index=index)
        return ReasoningObservation(family=family, question=self._entry["question"])

    def step(self, action: ReasoningAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReasoningObservation:
        if self._entry is None or self._state.step_count:
            error = "no task: call reset first" if self._entry is None else "the episode is over: call reset"
            return ReasoningObservation(family=self._state.family, done=True, error=error)
        self._state.step_count += 1
        score = float(self._verifier.score_answer(action.answer, self._entry))
        return ReasoningObservation(family=self._state.family, question=self._entry["question"], done=True, reward=score)

    @property
    def state(self) -> ReasoningState:
        return self._state


def _split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"no split {split!r} (this server has: {', '.join(SPLITS)})")
    return split


def main(argv: list[str] | None = None) -> None:
    """--family and --family-args become this server's defaults; the rest is `serve`'s (host, port, ...)."""
    import argparse

    from forge_rl.envs import serve

    family, args = default_family()
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--family", default=family)
    parser.add_argument("--family-args", default=json.dumps(args), help="the generator's options as JSON")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    os.environ["REASONING_FAMILY"], os.environ["REASONING_FAMILY_ARGS"] = known.family, known.family_args
    serve(ReasoningEnvironment, rest)


if __name__ == "__main__":
    main()
