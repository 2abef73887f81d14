"""The learner's split of a batch into PPO minibatches and how their optimizer steps' figures are merged."""

import torch

from forge_rl.core.config import load_config
from forge_rl.core.types import Episode
from forge_rl.recipes.grpo.learner import merged, minibatches
from forge_rl.recipes.grpo.main import optimizer_steps


def episode(group: str) -> Episode:
    return Episode(torch.tensor([1, 2]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, -1.0]), 0.0, 0, group)


def test_minibatches_hold_whole_groups_in_the_order_they_came():
    """A group's advantages compare its own games: a minibatch holding half a group would compare the half."""
    batch = [episode(g) for g in "aabbbccdda"]  # group a's last game came late
    parts = minibatches(batch, 3)
    assert [[batch[i].group_id for i in part] for part in parts] == [["a", "a", "a"], ["b", "b", "b"], ["c", "c", "d", "d"]]
    assert sorted(i for part in parts for i in part) == list(range(len(batch)))
    assert minibatches(batch, 1) == [list(range(len(batch)))]
    assert len(minibatches(batch, 9)) == 4, "never an empty minibatch"


def test_a_steps_figures_sum_counts_merge_extremes_as_extremes_and_average_the_rest_by_tokens():
    """A minibatch of 20 trained tokens weighs twice one of 10, as the trainer weighs its micro-batches."""
    steps = [{"loss": 1.0, "ratio_max": 1.5, "ratio_min": 0.9, "imitation_nll": 2.0, "forward_tokens": 300, "num_tokens": 20},
             {"loss": 4.0, "ratio_max": 1.1, "ratio_min": 0.7, "forward_tokens": 200, "num_tokens": 10}]
    assert merged(steps) == {"loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.7, "imitation_nll": 2.0, "forward_tokens": 500, "num_tokens": 30}


def test_the_lr_schedule_spans_every_optimizer_step():
    cfg = load_config("configs/blackjack_tiny_cpu.yaml", ["trainer.max_steps=10", "grpo.minibatches=4", "grpo.epochs=2"])
    assert optimizer_steps(cfg) == 80
