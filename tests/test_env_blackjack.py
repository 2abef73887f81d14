"""BlackJack server on 127.0.0.1, driven through the WebSocket client: rules, seeding, errors, limits."""

import asyncio
import json
import random
import urllib.request

import pyspiel
import pytest

from forge_rl.rollout.env_client import EnvCapacityError, EnvError, EnvSession
from forge_rl.envs.local import launch_local
from tests.test_blackjack_game import play as play_hands

MAX_SESSIONS = 4
STAND_HANDS = 6000  # EV standard error ~0.012: always stand -0.183 vs mimic the dealer -0.080 is 8 sigma apart


@pytest.fixture(scope="module")
def server():
    with launch_local("apps.blackjack.env:BlackJackEnvironment", max_concurrent_envs=MAX_SESSIONS) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


async def play(url, seed, policy):
    """One hand; policy(observation) -> 'HIT'/'STAND'. Returns every observation seen."""
    async with EnvSession(url) as session:
        seen = [(await session.reset(seed=seed)).observation]
        while not seen[-1]["done"]:
            seen.append((await session.step({"action": policy(seen[-1])})).observation)
        return seen


def basic_strategy(obs):
    rank = obs["dealer_card"][:-1]
    up = 11 if rank == "A" else 10 if rank in ("J", "Q", "K") else int(rank)
    total = obs["player_total"]
    if obs["soft"]:
        return "STAND" if total >= 19 or (total == 18 and up <= 8) else "HIT"
    if total >= 17 or (13 <= total <= 16 and up <= 6) or (total == 12 and 4 <= up <= 6):
        return "STAND"
    return "HIT"


def test_health_names_the_environment(server):
    health = json.load(urllib.request.urlopen(f"{server.url}/health"))
    assert health == {"status": "healthy", "environment": "BlackJackEnvironment", "max_concurrent_envs": MAX_SESSIONS,
                      "openenv": "0.10.0"}


def test_full_episodes_show_what_a_player_needs(server):
    for seed in range(20):
        seen = run(play(server.url, seed, basic_strategy))
        first, last = seen[0], seen[-1]
        assert len(first["player_cards"]) == 2 and first["dealer_card"] and first["step"] == 0
        assert first["legal_actions"] == ["HIT", "STAND"] and first["dealer_cards"] == []
        assert "Dealer shows" in first["text"] and str(first["player_total"]) in first["text"]
        assert last["done"] and last["reward"] in (-1.0, 0.0, 1.0) and last["legal_actions"] == []
        assert last["dealer_cards"][1] == first["dealer_card"]  # the up card is the second one
        assert last["step"] == len(seen) - 1
        for obs in seen[:-1]:
            assert obs["reward"] is None and not obs["done"]


def test_soft_hand_is_flagged(server):
    async def first_soft():
        async with EnvSession(server.url) as session:
            for seed in range(200):
                obs = (await session.reset(seed=seed)).observation
                if any(c.startswith("A") for c in obs["player_cards"]) and obs["player_total"] < 21:
                    return obs
    obs = run(first_soft())
    assert obs["soft"] and "soft" in obs["text"]


def test_same_seed_same_deal_and_the_same_dealer_whatever_the_player_does(server):
    """A GRPO group compares decisions on one seed: hitting must not change the dealer's cards."""
    a = run(play(server.url, 11, lambda o: "STAND"))
    assert a == run(play(server.url, 11, lambda o: "STAND"))

    def hits_safely_and_dealer_draws(seed):  # 11 or less: one hit cannot bust
        stand = run(play(server.url, seed, lambda o: "STAND"))
        return stand[0]["player_total"] <= 11 and len(stand[-1]["dealer_cards"]) > 2

    seed = next(s for s in range(200) if hits_safely_and_dealer_draws(s))
    stand = run(play(server.url, seed, lambda o: "STAND"))[-1]
    hit_once = run(play(server.url, seed, lambda o: "HIT" if o["step"] == 0 else "STAND"))[-1]
    hit_twice = run(play(server.url, seed, lambda o: "HIT" if o["step"] <= 1 else "STAND"))[-1]
    assert hit_once["player_cards"][:2] == stand["player_cards"]
    assert hit_once["dealer_cards"] == stand["dealer_cards"]
    assert hit_twice["player_cards"][:3] == hit_once["player_cards"]
    if hit_twice["player_total"] <= 21:
        assert hit_twice["dealer_cards"] == stand["dealer_cards"]
    dealt = hit_twice["player_cards"] + hit_twice["dealer_cards"]
    assert len(set(dealt)) == len(dealt)  # one deck, without replacement
    deals = {tuple(run(play(server.url, s, lambda o: "STAND"))[0]["player_cards"]) for s in range(10)}
    assert len(deals) > 5


def openspiel_hand(seed, decide):
    """The dealing spec applied to pyspiel directly (deal and dealer from the top, hits from the bottom), the
    player's decisions by decide(state) -> 0 (HIT) or 1 (STAND); the final state."""
    shoe = list(range(52))
    random.Random(seed).shuffle(shoe)
    state, top, hits = pyspiel.load_game("blackjack").new_initial_state(), 0, 0
    while not state.is_terminal():
        if state.is_chance_node():
            state.apply_action(shoe[top])
            top += 1
            continue
        action = decide(state)
        state.apply_action(action)
        if action == 0:
            hits += 1
            state.apply_action(shoe[-hits])
    return state


def openspiel_return(seed, hits_below):
    """For a player who hits below a total."""
    return openspiel_hand(seed, lambda state: 0 if state.get_best_player_total(0) < hits_below else 1).returns()[0]


@pytest.mark.parametrize("name, ev", [("always_stand", -0.183), ("mimic_dealer", -0.080)])
def test_returns_match_openspiel_and_the_reference_ev(server, name, ev):
    """Per-hand returns equal OpenSpiel's own game under the dealing spec; the mean is the reference EV."""
    hits_below = {"always_stand": 0, "mimic_dealer": 17}[name]  # both decide on the total alone

    def policy(observation):
        return "HIT" if observation["player_total"] < hits_below else "STAND"

    returns = [final["reward"] for final in play_hands(server, range(STAND_HANDS), policy)]
    for seed in range(0, STAND_HANDS, 97):
        assert returns[seed] == openspiel_return(seed, hits_below), seed
    mean = sum(returns) / STAND_HANDS
    assert abs(mean - ev) < 0.04, mean  # 3.3 standard errors; always stand and mimic are 0.1 apart


def replayed_expected_return(seed, actions):
    """The hand (seed, the player's actions) replayed in OpenSpiel with each possible hole card, the dealer's
    turn then averaged over OpenSpiel's own chance outcomes (grouped by card value: suits never matter)."""
    decisions = iter(actions)
    final = openspiel_hand(seed, lambda state: {"HIT": 0, "STAND": 1}[next(decisions)])
    if final.get_best_player_total(0) > 21:
        return -1.0

    def value(s, card):
        rank = s.action_to_string(pyspiel.PlayerId.CHANCE, card)[1:]
        return {"A": 1, "T": 10, "J": 10, "Q": 10, "K": 10}.get(rank) or int(rank)

    def by_value(s, outcomes):
        groups = {}
        for card, p in outcomes:
            first, total = groups.get(value(s, card), (card, 0.0))
            groups[value(s, card)] = (first, total + p)
        return list(groups.values())

    def dealer_turn(s):
        if s.is_terminal():
            return float(s.returns()[0])
        return sum(p * dealer_turn(s.child(card)) for card, p in by_value(s, s.chance_outcomes()))

    seen = set(final.cards(0)) | {final.dealers_visible_card()}
    hole_at = final.history().index(final.cards(final.dealer_id())[0])  # the dealer's first card is the hole card
    unseen = [(card, 1.0 / (52 - len(seen))) for card in range(52) if card not in seen]
    expected = 0.0
    for hole, p in by_value(final, unseen):
        s = final.get_game().new_initial_state()
        for i, action in enumerate(final.history()):
            if s.is_terminal() or (s.is_chance_node() and len(s.cards(0)) == len(final.cards(0)) and len(s.cards(s.dealer_id())) >= 2):
                break  # the player's turn is over: what follows is the dealer's
            s.apply_action(hole if i == hole_at else action)
        expected += p * dealer_turn(s)
    return expected


def test_expected_reward_averages_out_only_what_the_player_never_saw(server):
    """reward="expected": the return over the dealer's hole card and draws, exactly (the server's arithmetic
    against OpenSpiel replaying every hole card and draw); the default stays the hand's +1 / 0 / -1; a wrong
    name is refused."""

    async def go():
        async with EnvSession(server.url) as session:
            checked = 0
            for seed in range(30):
                for hit_below in (12, 17):
                    obs, actions = (await session.reset(seed=seed, reward="expected")).observation, []
                    while not obs["done"]:
                        actions.append("HIT" if obs["player_total"] < hit_below else "STAND")
                        obs = (await session.step({"action": actions[-1]})).observation
                    want = replayed_expected_return(seed, actions)
                    assert obs["reward"] == pytest.approx(want, abs=1e-9), (seed, obs)
                    checked += want not in (-1.0, 0.0, 1.0)
            assert checked > 30
            outcome = (await session.reset(seed=3)).observation
            outcome = (await session.step({"action": "STAND"})).observation
            assert outcome["reward"] in (-1.0, 0.0, 1.0) and "You " in outcome["text"] or "Push" in outcome["text"]
            with pytest.raises(EnvError, match="reward: expected one of outcome, expected, got 'luck'"):
                await session.reset(seed=3, reward="luck")

    run(go())


def test_illegal_and_malformed_actions_do_not_end_the_session(server):
    async def go():
        async with EnvSession(server.url) as session:
            start = (await session.reset(seed=5)).observation
            bad = (await session.step({"action": "DOUBLE"})).observation
            assert "illegal action 'DOUBLE'" in bad["error"] and not bad["done"] and bad["reward"] is None
            assert bad["player_cards"] == start["player_cards"] and bad["step"] == 0
            assert "illegal" in (await session.step({"action": 7})).observation["error"]
            with pytest.raises(EnvError, match="VALIDATION_ERROR"):
                await session.step({"move": "HIT"})
            end = (await session.step({"action": " stand "})).observation
            assert end["done"] and end["error"] is None
            after = (await session.step({"action": "HIT"})).observation
            assert "hand is over" in after["error"] and after["reward"] is None
            assert not (await session.reset(seed=6)).observation["done"]

    run(go())


def test_capacity_limit_gives_a_clear_error(server):
    async def go():
        sessions = [EnvSession(server.url, timeout_s=5) for _ in range(MAX_SESSIONS)]
        for s in sessions:
            await s.reset(seed=1)
        extra = EnvSession(server.url, timeout_s=5)
        with pytest.raises(EnvCapacityError, match="capacity"):
            await extra.reset(seed=1)
        await sessions[0].close()
        await asyncio.sleep(0.2)  # the server frees the slot when it sees the close
        assert not (await extra.reset(seed=1)).done
        for s in sessions[1:] + [extra]:
            await s.close()

    run(go())
