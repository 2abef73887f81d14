"""ReferenceModel: the frozen initial policy, for the KL term of the GRPO loss.

    training loop --token ids of a batch--> ReferenceModel.logprobs --> Trainer.train_step(batch, ref_logprobs)

Built as the Trainer's model, never updated: before the first update its log-probs equal the trainer's.
Stateless, so it runs as a service whose replicas split the batches. Only needed when grpo.kl_coef > 0.
"""

import torch
from monarch.actor import endpoint

from forge_rl.engines.titan.model import build_model, init_distributed, logprobs_of
from forge_rl.runtime.actor import ForgeActor


class ReferenceModel(ForgeActor):
    """Invariant: weights never change after setup."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        *,
        micro_batch_size: int,  # the trainer's (no default: one here was used instead of the config's)
        allowed_token_ids: list[int] | None = None,
        temperature: float = 1.0,
    ):
        self.model_path, self.dtype, self.micro_batch_size = model_path, dtype, micro_batch_size
        # As the Trainer's: the generator's sampling distribution (restriction and temperature).
        self.allowed_token_ids, self.temperature = allowed_token_ids, temperature

    @endpoint
    async def setup(self) -> None:
        """All ranks. Load the HF weights (sharded with FSDP2 if the mesh has several ranks)."""
        _, _, self.device = init_distributed()
        self.model, _ = build_model(self.model_path, self.device, self.dtype)
        self.model.eval().requires_grad_(False)

    @endpoint
    async def logprobs(self, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """All ranks of one replica; returns at once with the result. Per sequence [T] fp32
        log-probs aligned with its ids (position 0 is 0)."""
        return logprobs_of(
            self.model, token_ids, self.device, self.dtype, self.micro_batch_size, self.allowed_token_ids, self.temperature
        )
