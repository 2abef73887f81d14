"""BlackJack under OpenSpiel's rules, as an OpenEnv server.

The rules, the dealer and the returns are `pyspiel.load_game("blackjack")` (open-spiel 2.0.2):
one 52-card deck, HIT/STAND only, dealer stands on all 17s, +1 / 0 / -1. Nothing here decides
who wins. What this module adds is a reproducible deal and an observation a policy can act on.

Reproducibility: reset(seed) shuffles the 52 cards once with that seed. The initial deal and the
dealer's draws take cards from the top of that order, the player's hits from the bottom. So the
same seed and the same decisions give the same cards, and different decisions on one seed face
the same dealer: whether the player hits twice or stands, the dealer's hole card and draws are the
same cards, and the n-th hit is always the same card. Comparing decisions on one seed (a GRPO
group) then measures the decision, not the dealer's luck. Dealing from both ends of a shuffled deck
is still dealing without replacement from a uniformly shuffled deck: the game is OpenSpiel's, card
for card in distribution. A client can restore an episode on a fresh session by replaying seed +
actions.

Training reward (reset argument `reward`): "outcome" (default), the hand's +1 / 0 / -1; or "expected",
the hand's expected return given what the player saw (its cards and the dealer's visible card), the
dealer's hole card and draws averaged out exactly by OpenSpiel's rules (`expected_return`). Its mean over
deals is the same EV and a policy gradient built on it is the same in expectation (the player's decisions
never see the hole card), with the dealer's luck removed: the variance that drowns a small model's
hand-dependent signal (docs/real_models.md). Evaluations keep "outcome" (eval.reset_args).

Errors are observations: an illegal or unparseable action, or a step after the end, returns the
unchanged hand with `error` set and no reward; the session goes on. No penalty is applied here;
the app decides what an invalid answer costs.

    python -m apps.blackjack.env --host 0.0.0.0 --port 8000   # reads MAX_CONCURRENT_ENVS
"""

from __future__ import annotations

import functools
import random
import secrets
from typing import Any, Optional

import pyspiel
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from apps.blackjack.rules import ACTION_NAMES, ACTIONS, card_name as _card_name, hand  # noqa: F401 (hand: env's too)
REWARDS = ("outcome", "expected")


class BlackJackAction(Action):
    action: str | int = Field(description="'HIT' or 'STAND' (any case), or OpenSpiel's id 0 / 1")


class BlackJackObservation(Observation):
    """What the player may know. Cards are rank then suit ('10H', 'AS'); totals are OpenSpiel's."""

    player_cards: list[str] = Field(default_factory=list)
    player_total: int = Field(0, description="best total (an ace counts 11 unless that busts)")
    soft: bool = Field(False, description="an ace is counted as 11 in player_total")
    dealer_card: str = Field("", description="the dealer's visible card")
    dealer_cards: list[str] = Field(default_factory=list, description="all of them, once done")
    dealer_total: Optional[int] = Field(None, description="set once done")
    legal_actions: list[str] = Field(default_factory=list)
    step: int = Field(0, description="player decisions taken so far in this episode")
    seed: Optional[int] = Field(None, description="the seed this shoe was shuffled with")
    text: str = ""
    error: Optional[str] = Field(None, description="why the last action was refused, if it was")


class BlackJackState(State):
    seed: Optional[int] = None
    actions: list[str] = Field(default_factory=list)
    cards_dealt: int = Field(0, description="from the top of the shoe: the initial deal, then the dealer's draws")
    hits_dealt: int = Field(0, description="from the bottom of the shoe: the player's hits")


class BlackJackEnvironment(Environment[BlackJackAction, BlackJackObservation, BlackJackState]):
    """One hand per episode. Sessions share nothing, so any number may run at once."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._game = pyspiel.load_game("blackjack")
        self._spiel: pyspiel.State | None = None
        self._shoe: list[int] = []
        self._state = BlackJackState()
        self._reward = "outcome"

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, reward: str = "outcome", **kwargs: Any) -> BlackJackObservation:
        if reward not in REWARDS:
            raise ValueError(f"reward: expected one of {', '.join(REWARDS)}, got {reward!r}")
        self._reward = reward
        if seed is None:
            seed = secrets.randbits(31)
        self._shoe = list(range(52))
        random.Random(seed).shuffle(self._shoe)
        self._state = BlackJackState(episode_id=episode_id, seed=seed)
        self._spiel = self._game.new_initial_state()
        self._deal()
        return self._observe()

    def step(self, action: BlackJackAction, timeout_s: Optional[float] = None, **kwargs: Any) -> BlackJackObservation:
        if self._spiel is None:
            return self._observe(error="no hand in play: call reset first")
        if self._spiel.is_terminal():
            return self._observe(error="the hand is over: call reset for a new one")
        raw = action.action
        action_id = ACTIONS.get(raw.strip().upper()) if isinstance(raw, str) else raw
        if action_id not in self._spiel.legal_actions():
            legal = ", ".join(ACTION_NAMES[a] for a in self._spiel.legal_actions())
            return self._observe(error=f"illegal action {raw!r}: legal actions are {legal}")
        self._spiel.apply_action(action_id)
        self._state.actions.append(ACTION_NAMES[action_id])
        self._state.step_count += 1
        if action_id == ACTIONS["HIT"]:  # the one card a HIT asks for comes from the bottom
            self._state.hits_dealt += 1
            self._spiel.apply_action(self._shoe[-self._state.hits_dealt])
        self._deal()
        return self._observe()

    @property
    def state(self) -> BlackJackState:
        return self._state

    def _deal(self) -> None:
        """Resolve chance nodes from the top of the shoe: always legal, as the shoe holds each card once
        and a hand never takes all 52 (so top and bottom never meet)."""
        while self._spiel.is_chance_node():
            self._spiel.apply_action(self._shoe[self._state.cards_dealt])
            self._state.cards_dealt += 1

    def _observe(self, error: str | None = None) -> BlackJackObservation:
        s = self._spiel
        if s is None:
            return BlackJackObservation(error=error, text=error or "", metadata={})
        done = s.is_terminal()
        dealer = [_card_name(s, c) for c in s.cards(s.dealer_id())] if done else []
        obs = BlackJackObservation(
            **hand(s),
            dealer_cards=dealer,
            dealer_total=s.get_best_player_total(s.dealer_id()) if done else None,
            step=self._state.step_count,
            seed=self._state.seed,
            error=error,
            done=done,
            reward=self._final_reward() if done and error is None else None,
        )
        obs.text = _render(obs, float(s.returns()[0]) if done else None)
        return obs

    def _final_reward(self) -> float:
        return expected_return(self._spiel) if self._reward == "expected" else float(self._spiel.returns()[0])


def _value(state: pyspiel.State, card: int) -> int:
    rank = _card_name(state, card)[:-1]
    return {"A": 1, "J": 10, "Q": 10, "K": 10}.get(rank) or int(rank)


def expected_return(final: pyspiel.State) -> float:
    """The player's expected return over what it never saw: the dealer's hole card and draws, dealt without
    replacement from the cards not in the player's hand and not the dealer's visible one, by OpenSpiel's
    rules (the dealer hits 16 or less; a player bust loses). Plain arithmetic on card values (suits never
    matter): replaying every outcome in OpenSpiel costs far more CPU, which a small host takes from the
    model (tests/test_env_blackjack.py checks this against such a replay)."""
    player = final.get_best_player_total(0)
    if player > 21:
        return -1.0
    up = _value(final, final.dealers_visible_card())
    left = [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 16]  # cards of each value 1-10 in a full deck (index 0 unused)
    for value in [*(_value(final, card) for card in final.cards(0)), up]:
        left[value] -= 1
    return _dealer_outcome(player, up, up == 1, tuple(left))


@functools.lru_cache(maxsize=1 << 16)
def _dealer_outcome(player: int, hard: int, ace: bool, left: tuple[int, ...]) -> float:
    """The player's expected return against a dealer holding `hard` (aces as 1; `ace`: one of them) who draws
    from the cards `left` (count per value) until its best total reaches 17."""
    best = hard + 10 if ace and hard + 10 <= 21 else hard
    if best > 21:
        return 1.0
    if best >= 17:
        return float((player > best) - (player < best))
    cards = sum(left)
    return sum(n / cards * _dealer_outcome(player, hard + v, ace or v == 1, left[:v] + (n - 1,) + left[v + 1 :])
               for v, n in enumerate(left) if n)


def _render(obs: BlackJackObservation, outcome: float | None) -> str:
    hand = f"Your cards: {' '.join(obs.player_cards)} (total {obs.player_total}{', soft' if obs.soft else ''})."
    if not obs.done:
        text = f"{hand} Dealer shows: {obs.dealer_card}. Legal: {', '.join(obs.legal_actions)}."
    else:
        result = {1.0: "You win", 0.0: "Push", -1.0: "You lose"}[outcome]
        text = f"{hand} Dealer: {' '.join(obs.dealer_cards)} (total {obs.dealer_total}). {result}."
    return f"Error: {obs.error}. {text}" if obs.error else text


if __name__ == "__main__":
    from forge_rl.envs import serve

    serve(BlackJackEnvironment)
