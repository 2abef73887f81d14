"""BlackJack for a pretrained chat model: the same game (task.py), asked and answered in plain English.

task.py's terse prompt ("Dealer 10. You 17 soft. HIT or STAND?") suits a tiny model that learns every
token from scratch; a pretrained model (SmolLM2, Qwen3) reads a sentence better, and answers in free
text (`sampling.constrained: false`): the action is the first of "hit" and "stand" that the answer names
("Hit.", "I would stand.", "You should hit, since..."); an answer naming neither is invalid. A small chat
model seldom answers with the bare word (SmolLM2-135M: a few answers in a hundred), so a strict parse
would leave every group's games all invalid alike, with nothing for GRPO to compare. Rewards, reference
policies and their EVs are task.py's.
"""

from __future__ import annotations

import re
from typing import Any

from apps.blackjack.task import ACTIONS, REFERENCE_EV, REFERENCE_POLICIES, SAMPLE_OBSERVATION, _fields, card_value, eval_metrics, reward  # noqa: F401


def render_prompt(observation: Any) -> str:
    """"You are playing blackjack. Your hand totals 17 (soft: it has an ace counted as 11). The dealer's
    up card is 10. Do you hit or stand? Answer with one word: hit or stand." """
    obs = _fields(observation)
    soft = " (soft: it has an ace counted as 11)" if obs["soft"] else ""
    dealer = card_value(obs["dealer_card"])
    dealer = "an ace" if dealer == "A" else dealer
    return (
        f"You are playing blackjack. Your hand totals {obs['player_total']}{soft}. The dealer's up card is "
        f"{dealer}. Do you hit or stand? Answer with one word: hit or stand."
    )


def parse_action(text: str, observation: Any = None) -> dict[str, str] | None:
    """The first action a free-text answer names ('Hit.', 'I would stand'); None if it names neither."""
    named = [word.upper() for word in re.findall(r"[a-z]+", text.lower()) if word.upper() in ACTIONS]
    return {"action": named[0]} if named else None
