"""tests/yes_no_app.py with a hostile reward function (tests/test_bad_rewards.py; imported by name by the run and
by the dataset server): a row naming `bad` gets NaN, +-inf, a string, a bool, an exception or no answer at all
instead of its score. Each call is noted in the file $HOSTILE_CALLS, if set, to count what the server was sent."""

import math
import os
import time

from tests.yes_no_app import ACTIONS, parse_action, render_prompt  # noqa: F401

REFERENCE_POLICIES = {"always_yes": lambda observation: "yes"}
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "str": "0.7", "bool": True}


def reward(prompt_row: dict, answer: str) -> float:
    bad = prompt_row.get("bad", "")
    if os.environ.get("HOSTILE_CALLS"):
        with open(os.environ["HOSTILE_CALLS"], "a") as calls:
            calls.write(f"{bad or 'good'}\n")
    if bad == "raise":
        raise ZeroDivisionError("a reward function's own bug")
    if bad == "hang":
        time.sleep(3600)
    return BAD[bad] if bad else float(answer == prompt_row["answer"])
