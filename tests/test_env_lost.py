"""When the environment server is gone: an evaluation reports no evaluation, and training stops.

A real BlackJack server on loopback plays one real reset, then is stopped (as a crashed pod would be).
The games that follow find nothing at its address: each is aborted once its session's reconnect window
runs out. No policy is needed, since no game gets as far as asking it.
"""

import asyncio
from pathlib import Path

import pytest

from forge_rl.core.app import load_app
from forge_rl.rollout.evaluation import Evaluation
from forge_rl.rollout.rollouts import GroupsLost, Rollouts
from forge_rl.core.config import load_config
from forge_rl.rollout.env_client import EnvSession
from forge_rl.envs.local import launch_local

pytestmark = pytest.mark.timeout(300)


def rollouts_on(url: str) -> Rollouts:
    """No policy and no tokenizer: no game gets as far as asking the policy."""
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "blackjack_tiny_cpu.yaml",
                      ["env.max_concurrent=100", "env.timeout_s=5", "eval.num_games=8"])
    return Rollouts(cfg, load_app(cfg.app_module, cfg.sampling.constrained), None, None, url, None)


@pytest.fixture(scope="module")
def dead_url():
    with launch_local("apps.blackjack.env:BlackJackEnvironment", max_concurrent_envs=4) as server:
        async def one_reset():
            async with EnvSession(server.url) as session:
                return (await session.reset(seed=1)).observation
        assert "done" in asyncio.run(one_reset())  # the server answered
    return server.url  # stopped on leaving the block: nothing listens there any more


@pytest.mark.slow  # 30 s here, a minute in CI (the suite keeps under 20): make test-slow runs it
def test_an_evaluation_whose_games_all_aborted_reports_no_evaluation(dead_url):
    rollouts = rollouts_on(dead_url)
    values = asyncio.run(Evaluation(rollouts)())
    assert values == {"eval/games": 0}  # not eval/ev = 0.0 over "1 game"
    assert "could not connect" in rollouts.last_abort


def test_training_stops_when_every_game_of_many_groups_is_aborted(dead_url):
    rollouts = rollouts_on(dead_url)

    async def twenty_groups():  # at once, as concurrent rollout workers play them
        await asyncio.gather(*(rollouts.group(seed) for seed in range(20)))

    with pytest.raises(GroupsLost, match="the last 20 groups were lost, the last to session_lost .*could not connect.*is the environment server gone"):
        asyncio.run(twenty_groups())
    assert rollouts.lost_groups == {"session_lost": 20}
