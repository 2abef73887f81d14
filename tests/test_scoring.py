"""The trainer scores a batch with each id of its episodes' tree run once (a row holds a tree, each id
attending to its ancestors) and the output head only where a trained token is predicted (forge_rl/engines/titan/scoring.py): the loss and every gradient must be
those of scoring each episode alone over the whole vocabulary and every position."""

import asyncio

import pytest
import torch

from forge_rl.core.config import GRPOConfig, OptimizerConfig
from forge_rl.core.estimators import estimate
from forge_rl.core.objective import GRPOLoss
from forge_rl.core.types import Episode
from forge_rl.engines.titan.model import sequence_logprobs
from forge_rl.engines.titan.scoring import add_data, plan_forward
from forge_rl.engines.titan.trainer import Trainer
from forge_rl.models.tiny import build_tiny_model
from tests.steps import plain_data, train_step


def episode(ids: list[int], trained: list[int], reward: float, group: str) -> Episode:
    """`ids` with the positions `trained` sampled (behaviour log-probs made up, they only shift the ratio)."""
    mask = torch.zeros(len(ids))
    mask[trained] = 1
    return Episode(torch.tensor(ids), mask, -1.5 * mask, reward, 0, group)


def blackjack_like_groups() -> list[Episode]:
    """Two groups of games: each starts from its deal's prompt; games that answered alike saw the same next
    prompt (as BlackJack deals them the same card), but for the last game, whose hit drew another card (an
    environment not deterministic in its seed); answers are one token."""
    batch = []
    for g, prompt in enumerate(([5, 6, 7, 8, 9], [10, 11, 12, 13])):
        n = len(prompt)
        batch += [
            episode(prompt + [20], [n], -1.0, f"g{g}"),                        # stand
            episode(prompt + [21, 30, 31, 20], [n, n + 3], 1.0, f"g{g}"),      # hit, stand
            episode(prompt + [21, 30, 31, 21], [n, n + 3], -1.0, f"g{g}"),     # hit, hit (bust)
            episode(prompt + [20], [n], 0.0, f"g{g}"),                         # stand
        ]
    n = len(prompt)
    return batch + [episode(prompt + [21, 40, 41, 21], [n, n + 3], 1.0, "g1")]  # hit, another card, hit


@pytest.mark.parametrize("micro_batch_size, rows", [(8, [17]), (2, [17]), (1, [8, 8, 9])])
def test_a_batch_is_scored_by_its_tree_of_ids_in_rows_as_long_as_a_micro_batch(micro_batch_size, rows):
    """Group 0's tree holds 8 ids (its prompt and one path of 3), group 1's 9 (two paths that share a hit): a row
    takes episodes until it holds micro_batch_size x 8 ids (the longest episode's needed ids), so with 8 group 0's
    last game opens a row of its own (its path again)."""
    batch = blackjack_like_groups()
    t = Trainer("unused")._tensors(batch, None)
    plan = plan_forward(t["tokens"], t["lengths"], t["mask"], list(range(len(batch))), micro_batch_size)
    assert [len(ids) for ids in plan.ids] == rows
    for b in range(len(batch)):
        n = plan.needed[b]
        assert n == max(p for p in range(len(batch[b].tokens)) if batch[b].loss_mask[p])
        ids, positions, mask = plan.inputs([plan.row_of[b]])
        columns = torch.tensor(plan.columns[b])
        assert ids[0, columns].tolist() == t["tokens"][b, :n].tolist(), "an episode's ids, in order"
        assert positions[0, columns].tolist() == list(range(n)), "each at its own position"
        assert mask[0, 0, columns[-1]].nonzero().flatten().tolist() == columns.tolist(), "attending to its path alone"


def test_turn_credit_compares_the_games_that_reached_the_same_conversation():
    """GiGPO's step-level advantage: an answer also earns reward minus the mean reward of the games of its
    group that answered after the same ids; a state one game alone reached adds nothing."""
    batch = blackjack_like_groups()
    advantages = estimate(batch, GRPOConfig(estimator="dr_grpo", turn_credit=1.0, loss_agg="token_mean"))
    trained = [[round(float(a[p]), 4) for p in range(len(e.tokens)) if e.loss_mask[p]] for a, e in zip(advantages, batch)]
    # group 0: rewards [-1, 1, -1, 0], mean -0.25; the first answer's state is everyone's (its credit doubles),
    # the second answer's (after hit, card 30) is games 1 and 2's: rewards [1, -1], mean 0
    assert trained[:4] == [[-1.5], [2.5, 2.25], [-1.5, -1.75], [0.5]]
    # group 1: mean 0; the last game alone drew card 40, so its second answer keeps its episode advantage
    assert trained[4:] == [[-2.0], [2.0, 2.0], [-2.0, -2.0], [0.0], [2.0, 1.0]]
    plain = estimate(batch, GRPOConfig(estimator="dr_grpo", loss_agg="token_mean"))
    assert [float(a[0]) for a in plain] == [-0.75, 1.25, -0.75, 0.25, -1.0, 1.0, -1.0, 0.0, 1.0]


@pytest.mark.parametrize("micro_batch_size", [1, 8], ids=["two-rows", "one-row"])
@pytest.mark.parametrize("turn_credit", [0.0, 1.0], ids=["per-game", "per-turn"])
@pytest.mark.parametrize("allowed", [None, [20, 21]], ids=["free", "constrained"])
def test_shared_rows_give_the_loss_and_gradients_of_every_episode_scored_alone(tmp_path, allowed, turn_credit, micro_batch_size):
    model_dir = str(build_tiny_model(tmp_path / "tiny", seed=0))
    loss_fn = GRPOLoss(GRPOConfig(entropy_coef=0.1, estimator="dr_grpo", turn_credit=turn_credit, loss_agg="token_mean"))
    trainer = Trainer(model_dir, loss_fn, OptimizerConfig(), micro_batch_size=micro_batch_size, allowed_token_ids=allowed, temperature=0.7)
    asyncio.run(Trainer.setup._method(trainer))
    batch = blackjack_like_groups()
    t = trainer._tensors(batch, None)
    totals = loss_fn.prepare(t, **add_data(t, plain_data(loss_fn, batch)))
    everyone = list(range(len(batch)))
    plan = trainer._plan(t, everyone)

    shared = 0.0
    for rows, weight, served in trainer._micro_batches(plan, everyone):
        loss, _ = trainer._forward_loss(t, plan, rows, served, weight, totals)
        loss.backward()
        shared += loss.item()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()

    length = int(t["lengths"].max())
    lp, entropy = sequence_logprobs(trainer.model, t["tokens"][:, :length], allowed, 0.7, entropy=True)
    piece = {k: t[k][:, 1:length] for k in ("mask", "behaviour", "ages", "advantages")}
    alone, _ = loss_fn(lp[:, 1:], piece, entropy, totals)
    alone.backward()

    assert shared == pytest.approx(alone.item(), abs=1e-6)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_train_step_reports_the_tokens_it_ran_through_the_model(tmp_path):
    """`forward_tokens`: the rows run, each padded to its micro-batch's longest (the figure behind the bench's
    tokens per second): one row of 17 ids for a batch of 64 ids."""
    model_dir = str(build_tiny_model(tmp_path / "tiny", seed=0))
    loss_fn = GRPOLoss(GRPOConfig(estimator="dr_grpo", loss_agg="token_mean"))
    trainer = Trainer(model_dir, loss_fn, OptimizerConfig(), micro_batch_size=2)
    asyncio.run(Trainer.setup._method(trainer))
    batch = blackjack_like_groups()
    metrics = train_step(trainer, batch)
    assert sum(len(e.tokens) for e in batch) == 64
    assert metrics["forward_tokens"] == 17
