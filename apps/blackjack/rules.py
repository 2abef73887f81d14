"""BlackJack as the player sees an OpenSpiel state: the action ids, card names and the visible hand. Shared by
the server (env.py, in the server virtualenv) and outside.py (in the training one), so it imports no openenv."""

from __future__ import annotations

from typing import Any

import pyspiel

ACTIONS = {"HIT": 0, "STAND": 1}  # OpenSpiel's action ids
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


def card_name(state: pyspiel.State, card: int) -> str:
    suit_rank = state.action_to_string(pyspiel.PlayerId.CHANCE, card)  # OpenSpiel's "CT", "HA"
    return suit_rank[1:].replace("T", "10") + suit_rank[0]


def _hard_total(names: list[str]) -> int:
    """Aces as 1: only to tell whether OpenSpiel's best total counted an ace as 11 (soft)."""
    faces = {"A": 1, "J": 10, "Q": 10, "K": 10}
    return sum(faces.get(n[:-1]) or int(n[:-1]) for n in names)


def hand(s: pyspiel.State) -> dict[str, Any]:
    """What the player sees of an OpenSpiel BlackJack state: its cards and best total (soft when an ace
    counts 11), the dealer's visible card, the legal actions. Also read by outside.py."""
    player = [card_name(s, c) for c in s.cards(0)]
    total = s.get_best_player_total(0)
    legal = [] if s.is_terminal() else [ACTION_NAMES[a] for a in s.legal_actions()]
    return {"player_cards": player, "player_total": total, "soft": total == _hard_total(player) + 10,
            "dealer_card": card_name(s, s.dealers_visible_card()), "legal_actions": legal}
