"""Records passed between forge_rl components (a stable contract: change with care)."""

from dataclasses import dataclass, field

import torch


@dataclass
class Episode:
    """One rollout (possibly many turns) of one prompt/seed, as the trainer consumes it.

    The token axis T covers the whole conversation in order: prompt, each sampled answer and each
    environment reply. Only tokens the policy sampled are trained (loss_mask), and their
    behaviour log-probs are the ones the generator sampled them with, so the loss's ratio is a
    real importance ratio. Episodes of one group share group_id; advantages compare them.
    """

    tokens: torch.Tensor  # [T] int64 all ids: prompt + sampled + environment-turn ids
    loss_mask: torch.Tensor  # [T] 1 where the policy sampled the token, 0 for prompt/env/padding
    behaviour_logprobs: torch.Tensor  # [T] fp32 log-prob each sampled token had when sampled; 0 where mask is 0
    reward: float  # the episode's total reward
    policy_version: int  # the OLDEST policy version that sampled any token of it (staleness is judged by it)
    group_id: str  # shared by all episodes of one prompt/seed
    # [T] int64 the policy version that sampled each token, -1 where mask is 0. With partial rollouts one
    # answer can mix versions. None at construction: every sampled token by policy_version.
    token_versions: torch.Tensor | None = None
    # A chat-agent rollout whose record was sealed into several segments gives one Episode per segment,
    # all with its rollout_id and reward; group advantages count each rollout once. "": its own rollout.
    rollout_id: str = ""
    truncated: bool = False  # an answer of it was cut at sampling.max_tokens (finish_reason "length")

    def __post_init__(self):
        if self.token_versions is None:
            self.token_versions = torch.where(torch.as_tensor(self.loss_mask).bool(), self.policy_version, -1).long()
        if not (len(self.tokens) == len(self.loss_mask) == len(self.behaviour_logprobs) == len(self.token_versions)):
            raise ValueError(
                f"Episode {self.group_id!r}: tokens, loss_mask, behaviour_logprobs and token_versions must have one "
                f"entry per token, got {len(self.tokens)}, {len(self.loss_mask)}, {len(self.behaviour_logprobs)}, "
                f"{len(self.token_versions)}"
            )

    def __getstate__(self) -> dict:
        """Pickled with its tensors as raw bytes: Monarch pickles a tensor through torch.save, whose fixed
        cost per tensor outweighs an episode's few hundred ids, and a batch crosses processes three times a
        step (controller -> buffer -> controller -> trainer)."""
        state = dict(self.__dict__)
        for name in _EPISODE_TENSORS:
            t = state[name].detach().cpu().contiguous()
            state[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return state

    def __setstate__(self, state: dict) -> None:
        for name in _EPISODE_TENSORS:
            dtype, shape, data = state[name]
            dtype = getattr(torch, dtype)
            t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
            state[name] = t.reshape(shape)
        self.__dict__.update(state)


_EPISODE_TENSORS = ("tokens", "loss_mask", "behaviour_logprobs", "token_versions")


@dataclass
class Completion:
    """One sample the Generator drew for one prompt (`Generator.generate` returns n per prompt).

    The rollout loop turns the completions of an episode's turns into one Episode: token_ids become
    trained tokens (loss_mask 1), logprobs their behaviour_logprobs, token_versions their versions.
    Lists, not tensors: a completion is a few tokens and crosses a process boundary as it is.
    """

    prompt_ids: list[int]  # [P] token ids of the prompt, exactly as the engine saw them
    token_ids: list[int]  # [T] ids the policy sampled, in order; ends with the stop token when one ended it
    # [T] log-prob of each sampled token under the distribution that sampled it: after temperature, top-p/top-k
    # and allowed_token_ids, not the raw logits'.
    logprobs: list[float]
    # token_ids decoded, special tokens skipped: what an app parses its action from. A stop string ends it (kept
    # with include_stop_str_in_output) even inside the last token, which token_ids keep whole with its log-prob
    text: str
    finish_reason: str  # "stop" (stop token/string), "length" (max_tokens reached) or "abort" (cancelled)
    policy_version: int  # the OLDEST weights version that sampled a token of it (0: the initial weights)
    # [T] the weights version that sampled each token: with partial rollouts a weight update in the middle
    # of a request gives [v]*k + [v+1]*(T-k). Empty at construction: every token by policy_version.
    token_versions: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the engine reused (prefix caching), not recomputed

    def __post_init__(self):
        if not self.token_versions:
            self.token_versions = [self.policy_version] * len(self.token_ids)
        if not len(self.token_ids) == len(self.logprobs) == len(self.token_versions):
            raise ValueError(
                f"Completion: {len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs "
                f"and {len(self.token_versions)} token_versions"
            )
