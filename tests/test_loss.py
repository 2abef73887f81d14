"""GRPO loss checked against numbers worked out by hand (the arithmetic is in comments)."""

import math

import pytest
import torch

from forge_rl.core.config import GRPOConfig, ISCorrectionConfig
from forge_rl.core.loss import (
    is_weights,
    grpo_loss,
    kl_penalty,
    seq_mean,
    token_mean,
)
from forge_rl.engines.titan.model import position_logprobs

LN2 = math.log(2)


def grpo(**loss_keys) -> GRPOConfig:
    """The loss's knobs, without the default entropy bonus unless a test sets one, aggregated by token_mean
    (the numbers below were worked out for it) unless a test sets another."""
    return GRPOConfig(**{"entropy_coef": 0.0, "loss_agg": "token_mean", **loss_keys})


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0)


# Two sequences, 4 positions; seq 1's last position is not policy-sampled (mask 0).
# seq 0: A=+1, ratios [1, 1.5, 0.5, 1.1]; seq 1: A=-2, ratios [1, 1.5, 0.5, (masked)].
BEHAVIOUR = torch.tensor([[-1.0, -1, -1, -1], [-2.0, -2, -2, 0]])
LOG_RATIO = torch.tensor([[0.0, math.log(1.5), math.log(0.5), math.log(1.1)], [0.0, math.log(1.5), math.log(0.5), -30.0]])
ADV = torch.tensor([1.0, -2.0])[:, None].expand(2, 4)  # [B, T]: each sequence's advantage at every token
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def make_logprobs():
    return (BEHAVIOUR + LOG_RATIO).clone().requires_grad_(True)


def test_clipped_ratio_token_mean_by_hand():
    # clip band [0.8, 1.28].
    # seq 0 (A=+1): min(r, clip(r)) = [1, 1.28, 0.5, 1.1]        -> per-token [-1, -1.28, -0.5, -1.1]
    # seq 1 (A=-2): min(-2r, -2clip(r)) = [-2, -3, -1.6]          -> per-token [2, 3, 1.6]
    # token_mean = (-3.88 + 6.6) / 7 = 0.3885714
    lp = make_logprobs()
    loss, m = grpo_loss(lp, BEHAVIOUR, ADV, MASK, grpo())
    close(loss, 0.3885714)
    # clipped high: seq0 pos1 (1.5 > 1.28, A > 0); clipped low: seq1 pos2 (0.5 < 0.8, A < 0)
    close(m["clip_fraction_high"], 1 / 7)
    close(m["clip_fraction_low"], 1 / 7)
    close(m["clip_fraction"], 2 / 7)
    close(m["ratio_mean"], 7.1 / 7)  # (1+1.5+.5+1.1+1+1.5+.5)/7
    close(m["ratio_min"], 0.5)
    close(m["ratio_max"], 1.5)
    close(m["num_tokens"], 7.0)
    # d loss / d logprob = -r*A/7 where unclipped, 0 where clipped or masked.
    loss.backward()
    close(lp.grad, [[-1 / 7, 0, -0.5 / 7, -1.1 / 7], [2 / 7, 3 / 7, 0, 0]])


def test_seq_mean_by_hand():
    # seq 0 mean -3.88/4 = -0.97; seq 1 mean 6.6/3 = 2.2; mean of the two = 0.615
    loss, _ = grpo_loss(make_logprobs(), BEHAVIOUR, ADV, MASK, grpo(loss_agg="seq_mean"))
    close(loss, 0.615)


def test_aggregations_with_external_denominator():
    per_token = torch.tensor([[1.0, 2, 3], [4.0, 5, 6]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(token_mean(per_token, mask), 7 / 3)  # (1+2+4)/3
    close(token_mean(per_token, mask, denominator=7), 1.0)  # 7/7: normalised by a bigger batch
    close(seq_mean(per_token, mask), 2.75)  # (1.5 + 4) / 2
    close(seq_mean(per_token, mask, denominator=4), 1.375)


def test_symmetric_clip_bounds_change_result():
    # clip_high = 0.2: seq0 pos1 now clipped at 1.2 -> per-token -1.2 instead of -1.28
    # token_mean = (2.72 + 0.08) / 7 = 0.4
    loss, _ = grpo_loss(make_logprobs(), BEHAVIOUR, ADV, MASK, grpo(clip_high=0.2))
    close(loss, 0.4)


def test_ratio_is_not_one_against_behaviour_logprobs():
    lp = make_logprobs()
    loss, m = grpo_loss(lp, BEHAVIOUR, ADV, MASK, grpo())
    assert m["ratio_max"] > 1.4 and m["ratio_min"] < 0.6
    # d loss / d logprob = -A r / 7 where the ratio is inside the band, 0 where clipping holds it:
    # seq0 pos1 (r 1.5 > 1.28, A > 0) and seq1 pos2 (r 0.5 < 0.8, A < 0). A ratio taken against a
    # detached copy of the current log-probs (always 1) would give -A / 7 on every trained token.
    loss.backward()
    close(lp.grad, [[-1 / 7, 0, -0.5 / 7, -1.1 / 7], [2 / 7, 3 / 7, 0, 0]])


def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    # log r = ref - policy = [ln2, 0, -ln2]
    ref = torch.tensor([[-1.0 + LN2, -2.0, -3.0 - LN2]])
    close(kl_penalty(lp, ref, "k1"), [[-0.6931472, 0, 0.6931472]])  # -log r
    close(kl_penalty(lp, ref, "k2"), [[0.2402265, 0, 0.2402265]])  # (ln2)^2 / 2
    close(kl_penalty(lp, ref, "k3"), [[0.3068528, 0, 0.1931472]])  # r - 1 - log r: 2-1-.693, .5-1+.693
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k9")


def test_k3_stays_finite_where_the_reference_far_outweighs_the_policy():
    # log r = ref - policy = 100: e^100 overflows float32 (inf past ~88.7). Clamped as verl's low_var_kl:
    # log r to 20, k3 to 10, so the loss is finite and the clamped token gets no gradient (no inf, no nan).
    lp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0 + LN2]])
    close(kl_penalty(lp, ref, "k3"), [[10.0, 0.3068528]])
    loss, _ = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), grpo(kl_coef=0.1), ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    close(lp.grad, [[0.0, -0.05]])  # token 1: d k3 / d lp = 1 - r = -1 (r = 2), times 0.1 / 2 tokens


def test_kl_term_in_loss_by_hand():
    # ratio 1 and A = 0, so the loss is only kl_coef * mean k3 = 0.1 * (0.3068528+0.1931472)/2 = 0.025
    lp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.0 + LN2, -3.0 - LN2]])
    cfg = grpo(kl_coef=0.1, kl_estimator="k3")
    loss, m = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, ref_logprobs=ref)
    close(loss, 0.025)
    close(m["kl"], 0.25)
    # d k3 / d logprob = 1 - r: r=2 -> -1, r=.5 -> .5; times 0.1 / 2 tokens
    loss.backward()
    close(lp.grad, [[-0.05, 0.025]])
    with pytest.raises(ValueError):
        grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), cfg)


def test_entropy_and_token_logprobs_by_hand():
    # position 0: uniform over 4 -> ln 4 = 1.3862944
    # position 1: probs [.25, .75, 0, 0] (logits 0, ln3, -inf, -inf)
    #   entropy = .25 ln4 + .75 ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    logits = torch.tensor([[[0.0, 0, 0, 0], [0.0, math.log(3), -1e9, -1e9]]], requires_grad=True)
    lp, entropy = position_logprobs(logits, torch.tensor([[2, 1]]))
    close(entropy, [[1.3862944, 0.5623351]])
    close(lp, [[-1.3862944, -0.2876821]])  # ln .25, ln .75
    # bonus: loss = -0.01 * (1.3862944 + 0.5623351) / 2 = -0.0097431
    loss, m = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), grpo(entropy_coef=0.01), entropy=entropy)
    close(loss, -0.0097431)
    close(m["entropy"], 0.9743148)


def test_entropy_floor_turns_the_bonus_on_only_below_it():
    # The same two positions: mean entropy over the mask (1.3862944 + 0.5623351) / 2 = 0.9743148.
    # Below a floor of 1.0 the bonus acts as without a floor (-0.0097431); at or above a floor of 0.9 it is
    # off: loss 0 and no gradient. Masking position 0 out leaves mean 0.5623351: below 0.9, so on again.
    logits = torch.tensor([[[0.0, 0, 0, 0], [0.0, math.log(3), -1e9, -1e9]]], requires_grad=True)
    lp, entropy = position_logprobs(logits, torch.tensor([[2, 1]]))
    for floor, mask, loss_expected in ((1.0, [[1, 1]], -0.0097431), (0.9, [[1, 1]], 0.0), (0.9, [[0, 1]], -0.01 * 0.5623351)):
        logits.grad = None
        cfg = grpo(entropy_coef=0.01, entropy_floor=floor)
        loss, m = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.tensor(mask, dtype=torch.float32), cfg, entropy=entropy)
        close(loss, loss_expected)
        loss.backward(retain_graph=True)
        assert (logits.grad.abs().sum() > 0) == (loss_expected != 0.0)


def test_gradient_flows_only_through_masked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    lp, entropy = position_logprobs(logits, targets)
    behaviour = torch.where(mask.bool(), lp.detach() - 0.1, torch.zeros_like(lp))
    cfg = grpo(kl_coef=0.05, entropy_coef=0.01)
    ref = lp.detach() + 0.3
    loss, _ = grpo_loss(lp, behaviour, torch.tensor([[1.0], [-1.0]]), mask, cfg, ref_logprobs=ref, entropy=entropy)
    loss.backward()
    per_position = logits.grad.abs().sum(-1)  # [B, T]
    assert torch.all(per_position[mask == 0] == 0)
    assert torch.all(per_position[mask == 1] > 0)


# ---------------------------------------------------------------------------- IS correction


def corrected(level, mode, band):
    return grpo(is_correction=ISCorrectionConfig(level=level, mode=mode, threshold=list(band)))

# The same two sequences: trainer/behaviour ratios seq 0 [1, 1.5, 0.5, 1.1], seq 1 [1, 1.5, 0.5, (masked)].
# Products: seq 0 0.825, seq 1 0.75; geometric means 0.825^(1/4) = 0.95305, 0.75^(1/3) = 0.90856.


@pytest.mark.parametrize(
    "level, mode, band, expected",
    [
        ("token", "mask", (0.8, 1.25), [[1, 0, 0, 1], [1, 0, 0, 0]]),  # 1.5 and 0.5 leave the band
        ("token", "clip", (0.8, 1.25), [[1, 1.25, 0.8, 1.1], [1, 1.25, 0.8, 0]]),
        ("token", "trunc", (0.8, 1.25), [[1, 1.25, 0.5, 1.1], [1, 1.25, 0.5, 0]]),  # only the top is cut
        ("seq", "mask", (0.8, 1.25), [[1, 1, 1, 1], [0, 0, 0, 0]]),  # 0.825 in, 0.75 out
        ("seq", "mask", (0.7, 0.8), [[0, 0, 0, 0], [1, 1, 1, 0]]),
        ("geo", "mask", (0.95, 1.05), [[1, 1, 1, 1], [0, 0, 0, 0]]),  # 0.953 in, 0.909 out
        ("geo", "mask", (0.9, 0.95), [[0, 0, 0, 0], [1, 1, 1, 0]]),
    ],
)
def test_is_weights_by_hand(level, mode, band, expected):
    close(is_weights(LOG_RATIO, MASK, level, mode, *band), expected)


def test_sequence_ratio_compared_in_log_space_does_not_overflow():
    log_ratio = torch.tensor([[60.0, 60.0], [-60.0, -60.0]])  # products e^120 and e^-120
    close(is_weights(log_ratio, torch.ones(2, 2), "seq", "mask", 0.0, 1e300), [[1, 1], [1, 1]])
    close(is_weights(log_ratio, torch.ones(2, 2), "seq", "mask", 0.5, 2.0), [[0, 0], [0, 0]])


@pytest.mark.parametrize(
    "level, mode, band, loss, grad",
    [
        # ratio against the trainer's own detached log-probs is 1, so per-token = -w * A and
        # d loss / d logprob = -w * A / 7.
        # mask: seq 0 -(1 + 1) = -2, seq 1 +2 * 1 = 2 -> 0 / 7
        ("token", "mask", (0.8, 1.25), 0.0, [[-1 / 7, 0, 0, -1 / 7], [2 / 7, 0, 0, 0]]),
        # clip: seq 0 -4.15, seq 1 +2 * 3.05 = 6.1 -> 1.95 / 7
        ("token", "clip", (0.8, 1.25), 1.95 / 7, [[-1 / 7, -1.25 / 7, -0.8 / 7, -1.1 / 7], [2 / 7, 2.5 / 7, 1.6 / 7, 0]]),
        # trunc: seq 0 -3.85, seq 1 +2 * 2.75 = 5.5 -> 1.65 / 7
        ("token", "trunc", (0.8, 1.25), 1.65 / 7, [[-1 / 7, -1.25 / 7, -0.5 / 7, -1.1 / 7], [2 / 7, 2.5 / 7, 1 / 7, 0]]),
        # seq 1 masked whole: -4 / 7
        ("seq", "mask", (0.8, 1.25), -4 / 7, [[-1 / 7] * 4, [0, 0, 0, 0]]),
        ("geo", "mask", (0.95, 1.05), -4 / 7, [[-1 / 7] * 4, [0, 0, 0, 0]]),
    ],
)
def test_corrected_loss_and_gradient_by_hand(level, mode, band, loss, grad):
    lp = make_logprobs()
    value, m = grpo_loss(lp, BEHAVIOUR, ADV, MASK, corrected(level, mode, band))
    close(value, loss)
    value.backward()
    close(lp.grad, grad)
    close(m["ratio_max"], 1.5)  # the trainer/behaviour ratio, not the PPO ratio (1)
    close(m["ratio_min"], 0.5)
    assert "clip_fraction" not in m  # the PPO ratio is 1 with a correction: the clip never acts
    masked = {"mask": {"token": 4 / 7, "seq": 3 / 7, "geo": 3 / 7}}.get(mode, {}).get(level, 0.0)
    close(m["is_masked_fraction"], masked)


def test_correction_off_is_todays_loss_bit_for_bit():
    lp, lp_today = make_logprobs(), make_logprobs()
    loss, m = grpo_loss(lp, BEHAVIOUR, ADV, MASK, corrected("off", "clip", (0.9, 1.1)))
    # today's formula, written out
    mask = MASK.bool()
    ratio = torch.exp(torch.where(mask, lp_today - BEHAVIOUR, torch.zeros_like(lp_today)))
    adv = ADV
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    today = (per_token * mask).sum() / mask.sum()
    assert torch.equal(loss, today)
    loss.backward()
    today.backward()
    assert torch.equal(lp.grad, lp_today.grad)
    assert "is_masked_fraction" not in m


def test_behaviour_kl_by_hand():
    # k3 = r - 1 - ln r: 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1.1 -> 0.0046898, 1 -> 0
    # (0 + .0945349 + .1931472 + .0046898 + 0 + .0945349 + .1931472) / 7 = 0.0828649
    _, m = grpo_loss(make_logprobs(), BEHAVIOUR, ADV, MASK, grpo())
    close(m["behaviour_kl"], 0.0828649)


def test_is_correction_refuses_sequence_ratios_as_weights():
    for level in ("seq", "geo"):
        for mode in ("clip", "trunc"):
            with pytest.raises(ValueError, match="only masks"):
                is_weights(LOG_RATIO, MASK, level, mode, 0.5, 2.0)
    with pytest.raises(ValueError, match="level 'half'"):
        is_weights(LOG_RATIO, MASK, "half", "mask", 0.5, 2.0)


def test_sequence_level_ratio_clips_whole_sequences_by_their_geometric_mean():
    """GSPO (ratio_level sequence): each token carries its sequence's geometric-mean ratio. Seq 0's tokens
    [1.2, 1.2] keep 1.2 (inside [0.8, 1.28]); seq 1's [1.5, 1.5] are clipped whole (A > 0); seq 2's [2.0, 0.5]
    average to 1, so both train, where the token ratio clips its first token. A = +1 each, 6 tokens."""
    behaviour = torch.zeros(3, 2)
    lp = torch.log(torch.tensor([[1.2, 1.2], [1.5, 1.5], [2.0, 0.5]])).requires_grad_()
    adv, mask = torch.ones(3, 2), torch.ones(3, 2)
    loss, m = grpo_loss(lp, behaviour, adv, mask, grpo(ratio_level="sequence"))
    loss.backward()
    close(lp.grad, [[-1.2 / 6, -1.2 / 6], [0, 0], [-1 / 6, -1 / 6]])
    close(m["clip_fraction_high"], 2 / 6)
    lp.grad = None
    grpo_loss(lp, behaviour, adv, mask, grpo())[0].backward()  # the token ratio, for contrast
    close(lp.grad, [[-1.2 / 6, -1.2 / 6], [0, 0], [0, -0.5 / 6]])


def test_value_loss_by_hand_and_its_clip():
    """0.5 (V - R)^2 over the masked turns; clipped, a prediction that moved past +-clip from the step-start value
    counts at the clipped value when that is worse (PPO's and TRL's max of the two)."""
    from forge_rl.core.loss import value_loss

    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[0.5, -0.1, 7.0]], requires_grad=True)
    returns = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third is no turn's start
    plain = value_loss(new, old, returns, mask)
    torch.testing.assert_close(plain, torch.tensor(0.5 * (0.25 + 0.81) / 2))
    # clip 0.2: the first counts as 0.2 (error 0.64 > 0.25), the second stays (0.81 > 0.64 at -0.1 is itself)
    clipped = value_loss(new, old, returns, mask, clip=0.2, denominator=4.0)
    torch.testing.assert_close(clipped, torch.tensor(0.5 * (0.64 + 0.81) / 4))
    clipped.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.9 / 4, 0.0]]))  # the clipped one has no gradient
