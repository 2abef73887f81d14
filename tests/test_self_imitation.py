"""Self-imitation: which episodes join the pool, and the trainer's NLL term on them (real Trainer, tiny model)."""

import asyncio

import pytest
import torch

from forge_rl.core.config import GRPOConfig, OptimizerConfig, SelfImitationConfig
from forge_rl.core.objective import GRPOLoss
from forge_rl.recipes.grpo.self_imitation import ImitationPool, best_of_groups
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.model import sequence_logprobs
from forge_rl.engines.titan.trainer import Trainer
from forge_rl.core.types import Episode
from tests.steps import train_step


def episode(group_id: str, reward: float, answer: int = 7) -> Episode:
    tokens = torch.tensor([3, 40, 41, 42, answer, answer + 1])
    mask = torch.tensor([0, 0, 0, 0, 1, 1])
    return Episode(tokens, mask, torch.where(mask.bool(), -2.0, 0.0), reward, 0, group_id)


def test_best_of_each_group_joins_only_when_it_beats_the_group_mean():
    batch = [episode("a", r) for r in (0, 1, 1, 0)] + [episode("b", r) for r in (0, 0)] + [episode("c", r) for r in (-1, 1)]
    best = best_of_groups(batch)
    assert [(e.group_id, e.reward) for e in best] == [("a", 1), ("c", 1)]  # all-equal group b gives none
    assert best[0] is batch[1]  # the first of a group's best, the episode itself (its ids as sampled)


def test_pool_keeps_the_most_recent_and_samples_reproducibly():
    pool = ImitationPool(capacity=3, seed=0)
    for i in range(5):
        pool.add_batch([episode(f"g{i}", 1.0), episode(f"g{i}", 0.0)])
    assert len(pool) == 3 and [e.group_id for e in pool.episodes] == ["g2", "g3", "g4"]
    again = ImitationPool(capacity=3, seed=0)
    again.episodes.extend(pool.episodes)
    assert [e.group_id for e in pool.sample(2)] == [e.group_id for e in again.sample(2)]
    assert len(pool.sample(10)) == 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def trainer(model_dir, micro_batch_size=8) -> Trainer:
    grpo = GRPOConfig(entropy_coef=0.0, self_imitation=SelfImitationConfig(episodes=4, coef=1.0), loss_agg="token_mean")
    actor = Trainer(model_dir, GRPOLoss(grpo), OptimizerConfig(lr=1e-2, schedule="constant"), micro_batch_size=micro_batch_size)
    asyncio.run(Trainer.setup._method(actor))
    return actor


def answer_logprob(actor: Trainer, e: Episode) -> float:
    with torch.no_grad():
        lp, _ = sequence_logprobs(actor.model, e.tokens[None])
    return float((lp[0] * e.loss_mask).sum())


def test_imitated_episodes_gain_likelihood_where_grpo_alone_moves_nothing(model_dir):
    """A batch of equal rewards has zero advantages: without imitation the step leaves the policy as it
    was; with it, the imitated answers become likelier. Micro-batching does not change the NLL."""
    batch = [episode("a", 0.0, answer=9), episode("a", 0.0, answer=11)]
    imitate = [episode("p", 1.0, answer=20), episode("q", 1.0, answer=30), episode("r", 1.0, answer=50)]
    plain = trainer(model_dir)
    before = [answer_logprob(plain, e) for e in imitate]
    train_step(plain, batch, None)
    assert [answer_logprob(plain, e) for e in imitate] == pytest.approx(before, abs=1e-6)

    one, pieces = trainer(model_dir), trainer(model_dir, micro_batch_size=1)
    m_one = train_step(one, batch, None, imitate)
    m_pieces = train_step(pieces, batch, None, imitate)
    assert m_one["imitation_nll"] == pytest.approx(-sum(before) / 6, rel=1e-4)  # mean over the 6 answer tokens
    assert m_pieces["imitation_nll"] == pytest.approx(m_one["imitation_nll"], rel=1e-5)
    assert m_one["imitation_episodes"] == 3
    after = [answer_logprob(one, e) for e in imitate]
    assert all(a > b + 0.1 for a, b in zip(after, before)), (before, after)
