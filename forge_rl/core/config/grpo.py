"""The `grpo:` section: the algorithm's keys (estimator, loss terms, importance-sampling correction,
self-imitation), beside the run's sections in schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from forge_rl.core.config.checks import ConfigError, check_non_negative, check_positive


@dataclass
class ISCorrectionConfig:
    """Importance-sampling correction of the loss (core/loss.py `is_weights`; docs/off_policy.md)."""

    level: Literal["off", "token", "seq", "geo"] = "off"
    mode: Literal["mask", "clip", "trunc"] = "mask"
    threshold: list = field(default_factory=lambda: [0.5, 2.0])  # [low, high] band of the ratio's gate

    def check(self, key):
        t = self.threshold
        if not (
            isinstance(t, list) and len(t) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in t)
        ):
            raise ConfigError(f"{key}.threshold: expected [low, high], two numbers, got {t!r}")
        self.threshold = [float(x) for x in t]
        if not 0 <= t[0] <= 1 <= t[1] or t[0] == t[1]:
            raise ConfigError(f"{key}.threshold: expected 0 <= low <= 1 <= high and low < high, got {t}")
        if self.level in ("seq", "geo") and self.mode != "mask":
            raise ConfigError(
                f"{key}: level {self.level} with mode {self.mode} makes no sense (a sequence's ratio is no "
                "token's importance weight); use mode mask, or level token"
            )


@dataclass
class SelfImitationConfig:
    """Self-imitation (Oh et al. 2018; forge_rl/recipes/grpo/self_imitation.py): each group's best episode, when it beats
    the group's mean, joins a pool, and every train step also maximises the likelihood of `episodes` of them."""

    episodes: int = 0  # pool episodes replayed per train step; 0: off
    coef: float = 1.0  # weight of their mean token NLL beside the GRPO loss
    capacity: int = 4096  # the most recent best episodes kept

    def check(self, key):
        check_non_negative(self, key, "episodes", "coef")
        check_positive(self, key, "capacity")


@dataclass
class GRPOConfig:
    group_size: int = 4  # games per group, dealt from the same seed
    batch_size: int = 64  # groups per train step
    max_policy_age: int = 1  # drop data sampled more than this many versions ago
    # PPO's passes over a batch (Schulman et al. 2017): `epochs` passes of `minibatches` optimizer steps each, every
    # minibatch whole groups; weights go out once per batch, generation still plays the whole batch at once.
    # From the second optimizer step on the ratio to the behaviour policy leaves 1 and the clip can act; with
    # 1 and 1 (GRPO's one step per batch) the ratio is 1 at the step and the clip never acts
    minibatches: int = 1
    epochs: int = 1
    # The advantage estimator and its paper's loss (core/estimators/, docs/estimators.md): grpo, dr_grpo, rloo,
    # reinforce_pp, ppo (a value head's baseline per turn, GAE), gspo, cispo, sapo
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "gspo", "cispo", "sapo"] = "dr_grpo"
    # dr_grpo only: divide by the group's mean absolute reward (for rewards >= 0 its mean): the gradient of
    # log pass rate; each group that found a pass weighs as one labelled example (estimators/dr_grpo.py)
    normalize_mean: bool = False
    # null: the estimator's paper's (the check prints what it took). The ratio's band: >= 1 - clip_low and
    # <= 1 + clip_high (DAPO's clip-higher); cispo's weight is clipped above only
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    # dual-clip (Ye et al. 2020; verl's 3): a negative advantage's token loss is at most -dual_clip x A. null: off
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    # k2 follows grad KL(policy || ref), k3 grad KL(ref || policy); k1's expected gradient as a loss term is 0:
    # only with kl_in_reward (docs/estimators.md)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # the KL as a per-token penalty in the return (REINFORCE++), not a loss term
    # token_mean (DAPO) | seq_mean (GRPO: per answer, then over answers) | seq_sum (REINFORCE: each answer's
    # token sum, over answers) | token_sum (Dr.GRPO: the sum over answers x sampling.max_tokens)
    loss_agg: Optional[Literal["token_mean", "seq_mean", "seq_sum", "token_sum"]] = None
    ratio_level: Optional[Literal["token", "sequence"]] = None  # sequence: GSPO's ratio and clip per sequence
    policy_loss: Optional[Literal["clip", "cispo", "sapo"]] = None  # PPO's clip, CISPO's clipped weight, SAPO's gate
    sapo_tau_pos: float = 1.0  # SAPO's gate temperatures for positive and negative advantages (its paper's)
    sapo_tau_neg: float = 1.05
    # No bonus, as in GRPO (Shao et al. 2024) and DAPO (Yu et al. 2025): over a pretrained model's whole vocabulary
    # a bonus pushes free text toward noise; an app whose few answers must stay sampled sets its own
    entropy_coef: float = 0.0
    # The bonus acts only while the mean entropy per trained token is below this floor (None: always).
    entropy_floor: Optional[float] = None
    filter_zero_spread: bool = False  # DAPO dynamic sampling: skip groups whose rewards are all equal
    # Weight of each answer's own credit beside its game's: the games of a group that reached the same
    # conversation compared from there (GiGPO's step-level advantage; estimators/turn_credit.py). 0: off
    turn_credit: float = 0.0
    max_token_age: Optional[int] = None  # drop from the loss tokens sampled more than this many versions ago
    # DAPO's overlong handling (Yu et al. 2025) for answers cut at sampling.max_tokens: keep their episodes out of
    # the loss (they still count in their group's baseline); and/or a soft penalty, 0 to -1 over an answer's
    # last `overlong_buffer` tokens before max_tokens, added to the reward (0: off)
    overlong_filter: bool = False
    overlong_buffer: int = 0
    # ppo only (estimators/ppo.py). gamma = lambda = 1: the advantage is the return minus the head's value, the
    # policy gradient whatever the head knows (TRL's PPO: lambda 0.95, which bootstraps from the head)
    gamma: float = 1.0
    gae_lambda: float = 1.0
    # The value loss 0.5 (V - return)^2 per turn beside the policy loss, through the shared trunk (Schulman et
    # al. 2017, eq. 9; 0.1 as TRL's value-head PPO); value_clip: V kept within clip_low of its step-start value
    value_coef: float = 0.1
    value_clip: bool = False
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)
    self_imitation: SelfImitationConfig = field(default_factory=SelfImitationConfig)

    RETIRED_KEYS = {"normalize_std": "replaced by grpo.estimator: grpo divides by the group's std, dr_grpo does not"}

    def check(self, key):
        from forge_rl.core.estimators import ESTIMATORS, LOSS_SETTINGS  # the estimators' defaults, once loaded

        for name in LOSS_SETTINGS:  # resolved here, so that the run's config.yaml says what it trained with
            if getattr(self, name) is None:
                setattr(self, name, getattr(ESTIMATORS[self.estimator], name))
        self.check_loss(key)
        if self.group_size < 2 and self.estimator != "ppo":
            raise ConfigError(f"{key}.group_size: expected >= 2 (advantages compare a group; ppo needs none), got {self.group_size}")
        check_positive(self, key, "batch_size", "group_size", "minibatches", "epochs")
        if self.filter_zero_spread and self.group_size < 2:
            raise ConfigError(f"{key}.filter_zero_spread: refuses groups whose rewards are all equal, as a group of one always is: "
                              "set it false, or group_size >= 2")  # fmt: skip
        if self.minibatches > self.batch_size:
            raise ConfigError(f"{key}.minibatches: each holds whole groups, so at most batch_size ({self.batch_size}), got {self.minibatches}")
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{key}.{name}: expected 0 <= {name} <= 1, got {getattr(self, name)}")
        if self.estimator == "ppo" and self.value_coef <= 0:
            raise ConfigError(f"{key}.value_coef: expected > 0 with estimator ppo (it trains the value head), got {self.value_coef}")
        if self.estimator == "ppo" and self.turn_credit:
            raise ConfigError(f"{key}.turn_credit: compares a group's rewards; ppo's baseline is the value head's per turn: set it 0")
        check_non_negative(self, key, "max_policy_age", "clip_low", "clip_high", "kl_coef", "entropy_coef", "turn_credit", "overlong_buffer", "value_coef")
        check_positive(self, key, "sapo_tau_pos", "sapo_tau_neg")
        if self.normalize_mean and self.estimator != "dr_grpo":
            raise ConfigError(f"{key}.normalize_mean: a scale of dr_grpo's advantages, but estimator is {self.estimator}: set estimator dr_grpo")
        if self.clip_low >= 1:
            raise ConfigError(f"{key}.clip_low: expected < 1 (the ratio is clipped below at 1 - clip_low), got {self.clip_low}")
        if self.max_token_age is not None:
            check_non_negative(self, key, "max_token_age")
        if self.entropy_floor is not None and self.entropy_floor <= 0:
            raise ConfigError(f"{key}.entropy_floor: expected > 0 nats, or null for a bonus that always acts, got {self.entropy_floor}")
        if self.entropy_floor is not None and self.entropy_coef == 0:
            raise ConfigError(f"{key}.entropy_floor: {self.entropy_floor} holds the entropy up with the bonus, but entropy_coef is 0: set entropy_coef > 0")

    def check_loss(self, key):
        """Combinations that contradict the loss's papers, refused with the one to use."""
        if self.estimator == "dr_grpo" and self.loss_agg == "seq_mean":
            raise ConfigError(f"{key}.loss_agg: seq_mean divides each answer by its length, the 1/|o| bias Dr.GRPO removes: "
                              "use token_sum (its paper's) or token_mean, or estimator grpo")  # fmt: skip
        if self.ratio_level == "sequence" and self.loss_agg != "seq_mean":
            raise ConfigError(f"{key}.loss_agg: {self.loss_agg} with ratio_level sequence weighs a sequence by its length; "
                              "GSPO's objective is a mean over sequences: use seq_mean")  # fmt: skip
        if self.ratio_level == "sequence" and self.policy_loss != "clip":
            raise ConfigError(f"{key}.ratio_level: sequence is GSPO's clipped sequence ratio; policy_loss {self.policy_loss} "
                              "gates each token's own ratio: use ratio_level token")  # fmt: skip
        if self.dual_clip is not None and (self.dual_clip <= 1 or self.policy_loss != "clip"):
            raise ConfigError(f"{key}.dual_clip: bounds PPO's clipped loss for negative advantages, so > 1 with policy_loss "
                              f"clip (3 as verl), or null; got {self.dual_clip} with policy_loss {self.policy_loss}")  # fmt: skip
        if self.kl_coef > 0 and self.kl_estimator == "k1" and not self.kl_in_reward:
            raise ConfigError(f"{key}.kl_estimator: k1 as a loss term has zero expected gradient (E[grad log pi] = 0): "
                              "use k3 (grad KL(ref || policy)) or k2 (grad KL(policy || ref)), or set kl_in_reward true")  # fmt: skip
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ConfigError(f"{key}.kl_in_reward: true puts kl_coef x the KL in the return, but kl_coef is {self.kl_coef}: set it > 0")
