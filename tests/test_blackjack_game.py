"""apps/blackjack/task.py: the prompt shows what a decision needs, parsing is strict, rewards are exact; against
the server (on 127.0.0.1, in its own virtualenv), its observations render and its answers are accepted."""

import asyncio

import pytest

from apps.blackjack.task import ACTIONS, parse_action, render_prompt, reward
from forge_rl.envs.local import launch_local
from forge_rl.rollout.env_client import EnvSession

SESSIONS = 4


@pytest.fixture(scope="module")
def server():
    with launch_local("apps.blackjack.env:BlackJackEnvironment", max_concurrent_envs=SESSIONS) as srv:
        yield srv


def play(server, seeds, policy):
    """Each seed's hand played with policy(observation) -> answer text, SESSIONS sessions at a time; the last
    observations, in seed order."""

    async def hands(chunk):
        async with EnvSession(server.url) as session:
            out = []
            for seed in chunk:
                obs = (await session.reset(seed=seed)).observation
                while not obs["done"]:
                    obs = (await session.step(parse_action(policy(obs)))).observation
                out.append(obs)
            return out

    async def all_hands():
        return await asyncio.gather(*(hands(seeds[i::SESSIONS]) for i in range(SESSIONS)))

    chunks = asyncio.run(all_hands())
    return [chunks[i % SESSIONS][i // SESSIONS] for i in range(len(seeds))]

IN_PLAY = {
    "player_cards": ["AS", "6D"], "player_total": 17, "soft": True, "dealer_card": "10H",
    "dealer_cards": [], "dealer_total": None, "legal_actions": ["HIT", "STAND"], "step": 0,
    "seed": 4, "text": "", "error": None, "reward": None, "done": False,
}  # fmt: skip


def test_prompt_shows_dealer_card_total_softness_and_the_answer_format():
    assert render_prompt(IN_PLAY) == "Dealer 10. You 17 soft. HIT or STAND?"
    assert render_prompt({**IN_PLAY, "dealer_card": "KD"}).startswith("Dealer 10.")  # J/Q/K count 10
    assert render_prompt({**IN_PLAY, "dealer_card": "AC"}).startswith("Dealer A.")
    assert "You 17 hard." in render_prompt({**IN_PLAY, "soft": False, "player_cards": ["10S", "7D"]})
    assert "STAND or HIT?" in render_prompt({**IN_PLAY, "legal_actions": ["STAND", "HIT"]})


def test_prompt_is_whole_tokens_of_the_tiny_model():
    """Every word and number of the prompt is a token of the tiny model's vocabulary (none is [UNK])."""
    from forge_rl.models.tiny import UNK, build_tokenizer

    tokenizer = build_tokenizer()
    for dealer in ("2H", "9C", "10D", "QS", "AH"):
        for total in range(4, 22):
            prompt = render_prompt({**IN_PLAY, "dealer_card": dealer, "player_total": total})
            assert tokenizer.token_to_id(UNK) not in tokenizer.encode(prompt).ids, prompt


def test_prompt_accepts_the_server_observation(server):
    async def first():
        async with EnvSession(server.url) as session:
            return (await session.reset(seed=4)).observation

    obs = asyncio.run(first())
    assert f"You {obs['player_total']} " in render_prompt(obs)


@pytest.mark.parametrize("text,expected", [
    ("HIT", {"action": "HIT"}), ("stand", {"action": "STAND"}), ("  Hit\n", {"action": "HIT"}),
    ("STAND.", None), ("hit me", None), ("", None), ("DOUBLE", None), ("I will STAND", None),
])  # fmt: skip
def test_parse_action_is_strict(text, expected):
    assert parse_action(text) == expected


def test_parsed_actions_are_what_the_server_accepts(server):
    async def go():
        async with EnvSession(server.url) as session:
            for word in ACTIONS:
                await session.reset(seed=4)
                obs = (await session.step(parse_action(word.lower()))).observation
                assert obs["error"] is None and obs["step"] == 1, (word, obs)
            await session.reset(seed=4)
            return (await session.step(parse_action("stand"))).observation

    assert asyncio.run(go())["done"]


def test_reward():
    assert reward(IN_PLAY, invalid=False, invalid_penalty=1.5) == 0.0
    for result in (1.0, 0.0, -1.0):
        assert reward({**IN_PLAY, "done": True, "reward": result}, invalid=False, invalid_penalty=1.5) == result
    assert reward(IN_PLAY, invalid=True, invalid_penalty=1.5) == -1.5
    assert reward(None, invalid=True, invalid_penalty=0) == 0.0
    with pytest.raises(ValueError, match="must be >= 0"):
        reward(IN_PLAY, invalid=True, invalid_penalty=-1)


def test_reference_policies_reach_their_published_ev_on_many_deals(server):
    """Basic strategy, mimic-the-dealer and always-stand played on 3,000 seeded deals land near the EVs
    of docs/blackjack.md (-0.043, -0.080, -0.183; 95% interval about +-0.035)."""
    from apps.blackjack.task import REFERENCE_EV, REFERENCE_POLICIES

    expected = {"basic_strategy": -0.043, "mimic_dealer": -0.080, "always_stand": -0.183}
    assert REFERENCE_EV.keys() == expected.keys()  # the luck correction relies on the first one, basic strategy
    assert all(abs(REFERENCE_EV[name] - ev) < 0.001 for name, ev in expected.items())
    for name, policy in REFERENCE_POLICIES.items():
        total = sum(obs["reward"] for obs in play(server, list(range(3000)), policy))
        assert abs(total / 3000 - expected[name]) < 0.04, (name, total / 3000)
