"""BlackJack for a pretrained chat model: the same game (task.py), asked in plain English.

task.py's terse prompt ("Dealer 10. You 17 soft. HIT or STAND?") suits a tiny model that learns every
token from scratch; a pretrained model (SmolLM2, Qwen3) reads a sentence better. Its answer is either
constrained (`sampling.constrained: true`): one token, "Hit" or "Stand" (each one token of SmolLM2's and
Qwen3's tokenizers, and the word a chat model starts its answer with), so every answer is valid from the
first step and the trainer scores exactly the two-way distribution that sampled it; or free text, where the
action is the first of "hit" and "stand" the answer names ("Hit.", "I would stand.") and an answer naming
neither is invalid. Rewards, reference policies and their EVs are task.py's.
"""

from __future__ import annotations

import re
from typing import Any

from apps.blackjack.task import REFERENCE_EV, REFERENCE_POLICIES, SAMPLE_OBSERVATION, _fields, card_value, eval_metrics, reward  # noqa: F401

ACTIONS = ("Hit", "Stand")  # what constrained decoding samples: one token each
SYSTEM_PROMPT = "You play blackjack."  # instead of a chat template's default (SmolLM2's names itself)
_NAMES = {"HIT", "STAND"}


def render_prompt(observation: Any) -> str:
    """"Blackjack. You have 17 (soft: an ace counts 11). The dealer shows 10. Hit or stand?": every word is
    read by the model at every turn of every game, so a token less is a forward and a backward less."""
    obs = _fields(observation)
    soft = " (soft: an ace counts 11)" if obs["soft"] else ""
    dealer = card_value(obs["dealer_card"])
    dealer = "an ace" if dealer == "A" else dealer
    return f"Blackjack. You have {obs['player_total']}{soft}. The dealer shows {dealer}. Hit or stand?"


def parse_action(text: str, observation: Any = None) -> dict[str, str] | None:
    """The first action a free-text answer names ('Hit.', 'I would stand'); None if it names neither."""
    named = [word.upper() for word in re.findall(r"[a-z]+", text.lower()) if word.upper() in _NAMES]
    return {"action": named[0]} if named else None
