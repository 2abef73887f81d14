"""Advantage estimators (forge_rl/core/estimators/): numbers worked out by hand. Every estimator's expected update against the exact gradient, through the whole
training path: tests/test_exact_gradient.py."""

import math

import pytest
import torch

from forge_rl.core.config import GRPOConfig
from forge_rl.core.estimators import ESTIMATORS, estimate
from forge_rl.core.types import Episode

GROUP_ESTIMATORS = sorted(name for name, e in ESTIMATORS.items() if not e.values)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0)


def one_turn(rewards: list[float], group: str = "g", rollouts: list[str] | None = None) -> list[Episode]:
    """A group of one-answer episodes: prompt id 1, answer id 2 (trained)."""
    rollouts = rollouts or [""] * len(rewards)
    return [Episode(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.zeros(2), r, 0, group, rollout_id=o) for r, o in zip(rewards, rollouts)]


def per_episode(batch: list[Episode], **keys) -> list[float]:
    return [float(a[-1]) for a in estimate(batch, GRPOConfig(**keys))]


def test_each_estimator_by_hand():
    rewards = [3.0, 0, 0, 0]  # mean .75, centred [2.25, -.75, -.75, -.75], population std 1.299038
    close(per_episode(one_turn(rewards), estimator="dr_grpo"), [2.25, -0.75, -0.75, -0.75])
    close(per_episode(one_turn(rewards), estimator="grpo"), [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    # leave-one-out: 3 - 0, 0 - 1 (the others' mean is 3 / 3)
    close(per_episode(one_turn(rewards), estimator="rloo"), [3.0, -1, -1, -1])
    # REINFORCE++: group-centred, then divided by the std over the whole batch: groups [3,0,0,0] and [1,1,1,0]
    # centred [2.25,-.75,-.75,-.75] and [.25,.25,.25,-.75]; their population std over 8 is sqrt(8.5/8)
    batch = one_turn(rewards, "a") + one_turn([1.0, 1, 1, 0], "b")
    std = math.sqrt((2.25**2 + 3 * 0.75**2 + 3 * 0.25**2 + 0.75**2) / 8)
    close(per_episode(batch, estimator="reinforce_pp"), [x / std for x in [2.25, -0.75, -0.75, -0.75, 0.25, 0.25, 0.25, -0.75]])
    # no spread: no signal and no nan, whatever the estimator
    for name in GROUP_ESTIMATORS:
        close(per_episode(one_turn([2.0, 2, 2]), estimator=name), [0.0, 0, 0])


def test_a_rollout_sealed_into_several_episodes_counts_once():
    # rows 0 and 1 are two segments of one rollout (reward 1); rollouts [1, 0, 0]: mean 1/3
    batch = one_turn([1.0, 1, 0, 0], rollouts=["r", "r", "", ""])
    close(per_episode(batch, estimator="dr_grpo"), [2 / 3, 2 / 3, -1 / 3, -1 / 3])
    close(per_episode(batch, estimator="grpo"), [math.sqrt(2), math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], atol=1e-4)
    close(per_episode(batch, estimator="dr_grpo", normalize_mean=True), [2.0, 2.0, -1.0, -1.0])


def test_normalize_mean_weighs_every_group_that_found_a_pass_as_one_example():
    # 0/1 rewards, k of G pass: each pass (G - k) / k, each failure -1 (maximum-likelihood RL)
    close(per_episode(one_turn([1.0, 0, 0, 0]), normalize_mean=True), [3.0, -1, -1, -1])
    close(per_episode(one_turn([1.0, 1, 1, 0]), normalize_mean=True), [1 / 3, 1 / 3, 1 / 3, -1])
    for k in range(1, 8):
        close(sum(per_episode(one_turn([1.0] * k + [0.0] * (8 - k)), normalize_mean=True)[:k]) / (8 - k), 1.0)
    close(per_episode(one_turn([0.0] * 4), normalize_mean=True), [0.0] * 4)
    # signed rewards: divided by the mean ABSOLUTE reward 0.475, not the mean 0.025 (which gave the pass 39)
    close(per_episode(one_turn([1.0, 0, 0, -0.9]), normalize_mean=True), [0.975 / 0.475, -0.025 / 0.475, -0.025 / 0.475, -0.925 / 0.475])


def test_turn_credit_is_scaled_as_the_episode_term_is():
    """One pass of four, each a one-answer game (every answer in the same state): with normalize_mean the
    episode term is 3 and the per-turn term compares the same four rewards the same way, 3 again."""
    advantages = per_episode(one_turn([1.0, 0, 0, 0]), normalize_mean=True, turn_credit=1.0)
    close(advantages, [6.0, -2, -2, -2])
    # leave-one-out: 1 - 0 and 0 - 1/3, twice
    close(per_episode(one_turn([1.0, 0, 0, 0]), estimator="rloo", turn_credit=1.0), [2.0, -2 / 3, -2 / 3, -2 / 3])


def test_unknown_estimator_is_refused_by_the_registry():
    with pytest.raises(KeyError):
        estimate(one_turn([1.0, 0]), GRPOConfig(estimator="ppo2"))


def answer_of(length: int, reward: float, truncated: bool) -> Episode:
    """A one-answer episode: a prompt id, then `length` sampled ids."""
    n = 1 + length
    return Episode(torch.arange(n), torch.tensor([0] + [1] * length), torch.zeros(n), reward, 0, "g", truncated=truncated)


def test_dapo_soft_overlong_penalty_by_hand():
    """max_tokens 8, buffer 4: answers of up to 4 tokens keep their reward, 6 tokens lose 0.5, 8 (cut) lose 1.
    Rewards [1, 1, 1] become [1, 0.5, 0]; Dr.GRPO: [0.5, 0, -0.5]."""
    batch = [answer_of(4, 1.0, False), answer_of(6, 1.0, False), answer_of(8, 1.0, True)]
    advantages = estimate(batch, GRPOConfig(overlong_buffer=4), max_tokens=8)
    close([float(a[-1]) for a in advantages], [0.5, 0.0, -0.5])
    close([float(a[-1]) for a in estimate(batch, GRPOConfig())], [0.0, 0.0, 0.0])  # off by default


def test_overlong_penalty_is_a_rollouts_whatever_order_its_segments_come_in():
    """A chat-agent rollout sealed into two segments, one whose answer was cut (8 tokens of max_tokens 8: -1) and
    one short: the rollout's reward 1 takes its longest answer's penalty, 0, in either order (the segments
    once kept whichever came last). Rollouts [0, 1, 0]: Dr.GRPO [-1/3, -1/3, 2/3, -1/3]."""
    cut, short = answer_of(8, 1.0, True), answer_of(2, 1.0, False)
    others = [answer_of(2, 1.0, False), answer_of(2, 0.0, False)]
    for first, second in ((cut, short), (short, cut)):
        first.rollout_id = second.rollout_id = "r"
        batch = [first, second] + others
        advantages = estimate(batch, GRPOConfig(overlong_buffer=4), max_tokens=8)
        close([float(a[-1]) for a in advantages], [-1 / 3, -1 / 3, 2 / 3, -1 / 3])


def test_overlong_filter_keeps_cut_answers_out_of_the_loss_but_in_the_baseline():
    from forge_rl.core.episode import EpisodeRecord
    from forge_rl.core.objective import GRPOLoss
    from forge_rl.core.types import Completion

    record = EpisodeRecord([1, 2])
    record.add_completion(Completion([1, 2], [3, 4], [-0.1, -0.2], "", "length", 0))
    cut = record.to_episode(0.0, "g")
    assert cut.truncated, "finish_reason 'length' is recorded on the episode"
    batch = [answer_of(2, 1.0, False), cut]
    objective = GRPOLoss(GRPOConfig(overlong_filter=True))
    data, _ = objective.batch_data(batch, objective.masks(batch, 0))
    assert data["mask"][1].sum() == 0 and data["mask"][0].sum() == 2
    close(data["advantages"][0, 1:3], [0.5, 0.5])  # compared with the cut answer's reward 0 all the same


# ------------------------------------------------------------------------------------------- ppo


def three_turns(reward: float, values: list[float]) -> tuple[list[Episode], list[torch.Tensor]]:
    """One episode of three answers (2, 1 and 2 sampled ids after a prompt and two environment replies) and its
    values [T]: values[i] at each answer's first id, 9 (never read) elsewhere."""
    tokens = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 0, 0, 1, 1])
    v = torch.full((10,), 9.0)
    v[[2, 5, 8]] = torch.tensor(values)
    return [Episode(tokens, mask, torch.zeros(10), reward, 0, "g")], [v]


def ppo_per_turn(values: list[float], reward: float = 1.0, **keys) -> list[float]:
    batch, v = three_turns(reward, values)
    (a,) = estimate(batch, GRPOConfig(estimator="ppo", **keys), values=v)
    assert a[2] == a[3] and a[8] == a[9] and a[[0, 1, 4, 6, 7]].abs().sum() == 0, "each turn's advantage on its own ids only"
    return [float(a[2]), float(a[5]), float(a[8])]


def test_ppo_gae_by_hand():
    values = [0.2, 0.5, -0.4]
    # lambda = gamma = 1: the return minus each turn's value
    close(ppo_per_turn(values), [0.8, 0.5, 1.4])
    # lambda = 0: one-step TD errors r_k + V_k+1 - V_k, the last against the reward
    close(ppo_per_turn(values, gae_lambda=0.0), [0.5 - 0.2, -0.4 - 0.5, 1.0 + 0.4])
    # gamma 0.9, lambda 0.5: deltas [0.9 * 0.5 - 0.2, 0.9 * -0.4 - 0.5, 1 + 0.4] = [0.25, -0.86, 1.4], then
    # A_2 = 1.4, A_1 = -0.86 + 0.45 * 1.4 = -0.23, A_0 = 0.25 + 0.45 * -0.23
    close(ppo_per_turn(values, gamma=0.9, gae_lambda=0.5), [0.25 + 0.45 * -0.23, -0.23, 1.4])
    # no group needed: a group of one gets its advantage
    close(ppo_per_turn([0.0, 0.0, 0.0], reward=-1.0), [-1.0, -1.0, -1.0])


def test_ppo_without_values_is_refused():
    with pytest.raises(ValueError, match="value head"):
        estimate(one_turn([1.0, 0]), GRPOConfig(estimator="ppo"))
