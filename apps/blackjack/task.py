"""BlackJack as a training task: what the policy reads, how its answer becomes an action, what it earns.

These three functions are the whole contract between an OpenEnv environment and training
(forge_rl/core/app.py). They take the observation as the dict the client returns (env.py's
BlackJackObservation fields) and import nothing from the server.

The prompt shows the player's best total, whether it is soft and the dealer's up card: with
those a policy can reach basic strategy (EV -0.043 under OpenSpiel's rules); without them the
best it can do is always stand (EV -0.183). See docs/blackjack.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from forge_rl.core.app import observation_fields as _fields
from forge_rl.core.app import terminal_reward

ACTIONS = ("HIT", "STAND")  # the only answers parse_action accepts (also for constrained decoding)
# A hand as the client returns it: the config check renders its prompt against the tiny model's words.
SAMPLE_OBSERVATION = {"player_total": 17, "soft": True, "dealer_card": "10H", "legal_actions": ["HIT", "STAND"], "done": False}


def card_rank(card: str) -> str:
    """'10H' -> '10', 'AS' -> 'A': the suit never matters in BlackJack."""
    return card[:-1]


def card_value(card: str) -> str:
    """The dealer's card as a player weighs it: 2..10 (J, Q, K count 10) or A."""
    rank = card_rank(card)
    return "10" if rank in ("J", "Q", "K") else rank


def render_prompt(observation: Any) -> str:
    """The decision in as few tokens as it takes: "Dealer 10. You 17 soft. HIT or STAND?"

    A tiny model learning from scratch reads each fact best as one token at the same place before its
    answer every time: the dealer's card value, the player's total, soft or hard. The cards themselves
    are left out: basic strategy needs only those three facts (deciding on the exact cards gains
    0.0003 per hand), and listing them made every hand a different prompt, which the tiny model
    learned markedly worse from (docs/blackjack.md).
    """
    obs = _fields(observation)
    kind = "soft" if obs["soft"] else "hard"
    legal = " or ".join(obs.get("legal_actions") or ACTIONS)
    return f"Dealer {card_value(obs['dealer_card'])}. You {obs['player_total']} {kind}. {legal}?"


def parse_action(text: str, observation: Any = None) -> dict[str, str] | None:
    """'hit', ' STAND\\n' -> the action to send; anything else (extra words included) -> None."""
    word = text.strip().upper()
    return {"action": word} if word in ACTIONS else None


def reward(observation: Any, invalid: bool, invalid_penalty: float) -> float:
    """The hand's return (+1 / 0 / -1) once done, 0 before; -invalid_penalty for an unparseable answer."""
    return terminal_reward(observation, invalid, invalid_penalty)


def eval_metrics(results: list, references: dict[str, float]) -> dict[str, float]:
    """What an evaluation reports (the games' reward and invalid): EV first, the EV with the deals' luck
    taken out, then the outcomes.

    Luck-corrected EV = EV - basic strategy's EV on the same deals + its exact EV (a control variate):
    10,000 deals leave the raw EV +-0.02 (95%) from the truth, mostly luck the model shares with basic
    strategy on the same cards; the difference of the two is several times more precise."""
    n = max(len(results), 1)
    ev = sum(r.reward for r in results) / n
    values = {"eval/ev": ev}
    if "basic_strategy" in references:
        values["eval/ev_luck_corrected"] = ev - references["basic_strategy"] + REFERENCE_EV["basic_strategy"]
    return values | {
        "eval/win": sum(r.reward > 0 for r in results) / n,
        "eval/push": sum(r.reward == 0 and not r.invalid for r in results) / n,
        "eval/loss": sum(r.reward < 0 for r in results) / n,
        "eval/invalid_rate": sum(r.invalid for r in results) / n,
        "eval/games": len(results),
    }


# Reference policies, played on the same evaluation deals as the model so that its EV is read against
# theirs without the luck of the deals (docs/blackjack.md has their EVs over all deals).


def _dealer_value(obs: Mapping[str, Any]) -> int:
    value = card_value(obs["dealer_card"])
    return 11 if value == "A" else int(value)


def basic_strategy(observation: Any) -> str:
    """Basic strategy on (total, soft, dealer up card) for these rules: EV -0.043."""
    obs = _fields(observation)
    total, dealer = obs["player_total"], _dealer_value(obs)
    if obs["soft"]:
        return "STAND" if total >= 19 or (total == 18 and dealer <= 8) else "HIT"
    if total >= 17:
        return "STAND"
    if total >= 13:
        return "STAND" if dealer <= 6 else "HIT"
    if total == 12:
        return "STAND" if 4 <= dealer <= 6 else "HIT"
    return "HIT"


REFERENCE_POLICIES = {
    "basic_strategy": basic_strategy,
    "mimic_dealer": lambda observation: "HIT" if _fields(observation)["player_total"] <= 16 else "STAND",
    "always_stand": lambda observation: "STAND",
}

# Their exact EVs over all deals (docs/blackjack.md, exact enumeration); basic strategy's is the control
# variate of the luck-corrected EV (eval_metrics).
REFERENCE_EV = {"basic_strategy": -0.0428, "mimic_dealer": -0.080, "always_stand": -0.183}
