"""Agent apps (the chat-agent form) through Rollouts, with a real chat server and a real code-task server
on 127.0.0.1. No policy: the agents of tests/agent_apps.py never ask it."""

import asyncio
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forge_rl.core.app import load_app
from forge_rl.core.config import load_config
from forge_rl.envs.local import launch_local
from forge_rl.models.tiny import build_tiny_model
from forge_rl.rollout.evaluation import Evaluation
from forge_rl.rollout.rollouts import GROUPS_LOST_BEFORE_GIVING_UP, GroupsLost, Rollouts
from tests import agent_apps

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "blackjack_agent_tiny_cpu.yaml"
GROUP = 4


@pytest.fixture(scope="module")
def code_tasks():
    with launch_local("apps.coder.env", max_concurrent_envs=16, timeout_s=180) as server:
        yield server


def rollouts(tmp_path, url: str) -> Rollouts:
    cfg = load_config(CONFIG, ["app_module=tests.agent_apps", f"grpo.group_size={GROUP}", "eval.num_games=3", "env.max_concurrent=8"])
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny", seed=0))
    return Rollouts(cfg, load_app(cfg.app_module), tokenizer, None, url, None)


def test_agents_reset_with_the_runs_reset_args(tmp_path, code_tasks):
    """env.reset_args reach an agent's ctx.env.reset in training, eval.reset_args over them in evaluation
    (as for the environment form): the agents report the synth family each reset chose."""
    r = rollouts(tmp_path, code_tasks.url)
    r.cfg.env.reset_args, r.cfg.eval.reset_args = {"task_set": "synth", "family": 2}, {"family": 1}
    agent_apps.fail_one = False

    async def main():
        try:
            await r.group(7)
            return await Evaluation(r)()
        finally:
            await r.close()

    evaluation = asyncio.run(main())
    assert [reward for reward, _ in r.recent] == [2.0] * GROUP
    assert evaluation == {"eval/reward": 1.0, "eval/games": 3}


def test_a_failed_agent_cancels_the_others_of_its_group(tmp_path, code_tasks, caplog):
    """One agent of a group raises while the others hold their environment sessions and chat rollouts:
    the group is lost at once, counted by its error, and the others are cancelled, their sessions back in
    the pool and their rollouts ended (they played on before, holding them); the run goes on."""
    r = rollouts(tmp_path, code_tasks.url)
    agent_apps.fail_one, agent_apps.started[:], agent_apps.cancelled[:] = True, [], []

    async def main():
        try:
            group = await asyncio.wait_for(r.group(3), 120)
            server = (await r.agents).server
            return group, r.sessions.free.qsize(), dict(server.rollouts)
        finally:
            await r.close()

    with caplog.at_level(logging.WARNING, logger="forge_rl.rollout.rollouts"):
        group, free, open_rollouts = asyncio.run(main())
    assert group is None and r.lost_groups == {"RuntimeError": 1} and "lost to RuntimeError" in caplog.text and "this agent failed" in caplog.text
    assert len(agent_apps.started) == GROUP and len(agent_apps.cancelled) == GROUP - 1
    assert free == 8 and open_rollouts == {}


def test_groups_whose_agents_never_ask_the_policy_are_counted_and_stop_the_run_when_they_repeat(tmp_path, code_tasks, caplog):
    """These agents never call the model, so no game has an episode: each group is dropped, counted
    (rollout/lost_groups/no_episode) and said once in the log, and as many in a row as lose a run to a gone
    environment stop it."""
    r = rollouts(tmp_path, code_tasks.url)
    agent_apps.fail_one = False

    async def main():
        try:
            first = await r.group(7)
            with pytest.raises(GroupsLost, match=f"groups were lost, the last to no_episode .{GROUP} of a group's games ended without asking the policy"):
                for seed in range(8, 8 + GROUPS_LOST_BEFORE_GIVING_UP):
                    await r.group(seed)
            return first
        finally:
            await r.close()

    with caplog.at_level(logging.WARNING, logger="forge_rl.rollout.rollouts"):
        first = asyncio.run(main())
    assert first is None and r.lost_groups == {"no_episode": GROUPS_LOST_BEFORE_GIVING_UP}
    assert caplog.text.count("a game was lost to no_episode") == 1 and "ended without asking the policy" in caplog.text


def test_an_agents_reward_that_is_no_finite_number_loses_its_group_and_its_evaluation_games(tmp_path, code_tasks):
    """run_agent's reward is checked as every reward is: NaN, inf or a string loses the group, counted by its
    reason, and an evaluation leaves such games out (eval/games 0 here) instead of stopping the run."""
    r = rollouts(tmp_path, code_tasks.url)
    agent_apps.fail_one = False

    async def main():
        try:
            groups = []
            for agent_apps.reward in (float("nan"), float("inf"), "0.7"):
                groups.append(await r.group(7))
            return groups, await Evaluation(r)()
        finally:
            agent_apps.reward = None
            await r.close()

    groups, evaluation = asyncio.run(main())
    assert groups == [None] * 3 and r.lost_groups == {"reward_not_finite": 2, "reward_not_a_number": 1}
    assert evaluation == {"eval/games": 0} and r.groups_lost_in_a_row == 3
