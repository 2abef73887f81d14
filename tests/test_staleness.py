"""How stale trained data can be, measured and bounded where it is produced (asynchronous mode)."""

import torch

from forge_rl.core.types import Episode
from forge_rl.recipes.grpo.learner import token_age_figures
from forge_rl.recipes.grpo.loop import InFlight


def episode(versions: list[int]) -> Episode:
    """A prompt token, then one sampled token per entry of `versions`."""
    n = len(versions) + 1
    return Episode(torch.arange(n), torch.tensor([0] + [1] * len(versions)), torch.zeros(n), 0.0, min(versions), "g",
                   token_versions=torch.tensor([-1] + versions))


def test_token_ages_are_counted_per_trained_token_not_per_episode():
    # trained at version 5: a partial rollout of tokens sampled at 3, 4, 5, and an episode of version 5
    figures = token_age_figures([episode([3, 4, 5]), episode([5, 5, 5, 5, 5])], trained_version=5)
    assert abs(figures["train/token_age_p90"] - 1.3) < 1e-6  # sorted ages 0 x6, 1, 2: between the 7th and 8th
    assert abs(figures["train/token_age_mean"] - 3 / 8) < 1e-6  # ages 2, 1, 0 and five 0s; the prompt not counted
    assert figures["train/token_age_ge2"] == 1 / 8


def test_no_group_starts_while_the_oldest_in_flight_is_on_its_last_trainable_version():
    in_flight = InFlight(max_age=1)
    assert in_flight.admits(0)
    in_flight.start(0)
    in_flight.start(0)
    assert in_flight.admits(0), "groups of the current version may run side by side"
    assert not in_flight.admits(1), "version 1 out: the groups of version 0 must end first (trained at age 1 at most)"
    in_flight.end(0)
    assert not in_flight.admits(1) and len(in_flight) == 1
    assert not in_flight.admits(1, worker="b")  # another worker: another wait
    in_flight.end(0)
    assert in_flight.admits(1) and len(in_flight) == 0
    assert in_flight.waits == 2, "two workers, each turned away on every poll of its wait: two waits"
    in_flight.start(1)
    assert not in_flight.admits(2) and in_flight.waits == 3, "turned away again after being admitted: a new wait"
    assert InFlight(max_age=2).admits(7) and not _with(InFlight(max_age=2), 5).admits(7) and _with(InFlight(max_age=2), 6).admits(7)


def _with(in_flight: InFlight, version: int) -> InFlight:
    in_flight.start(version)
    return in_flight
