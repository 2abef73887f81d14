"""PPO's value head (core/estimators/ppo.py): a linear layer from the policy's final hidden state (after the last
norm: what the output head reads) to a scalar, on the trainer's model only.

    model.value_head   nn.Linear(dim, 1), zero at the start: V = 0, so the first step's advantages are the returns

In the model's module tree, so FSDP2, AdamW and checkpoints take it (attached after PEFT froze the rest, so it
trains). Weight sync and the HF export leave it out: it lives in the run's checkpoints only. It is read where
the output head is (model.py `scoring_head`). The trunk is shared (Schulman et al. 2017, eq. 9).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

NAME = "value_head"


def attach(model: torch.nn.Module) -> None:
    """Give `model` (on any device, meta included) its value head."""
    dim = model.norm.weight.shape[0]
    model.value_head = torch.nn.Linear(dim, 1, device=model.norm.weight.device)


def has_value_head(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, NAME, None), torch.nn.Module)


def initial_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The head's starting values under their state-dict names (zeros: the same on every rank); {} without one."""
    if not has_value_head(model):
        return {}
    return {f"{NAME}.weight": torch.zeros(model.value_head.weight.shape), f"{NAME}.bias": torch.zeros(1)}


def policy_state(state: dict) -> dict:
    """A model state dict without the value head: what the generators and an HF export take."""
    return {k: v for k, v in state.items() if not k.startswith(f"{NAME}.")}


@contextmanager
def head_values(model: torch.nn.Module):
    """Within it, each forward of `model` appends to the yielded list the head's values [N] (fp32) of the N hidden
    states the output head reads (after `scoring_head`'s selection, when that is entered first); nothing without
    a head. Computed inside the forward, where FSDP2 has the head's parameters gathered."""
    out: list[torch.Tensor] = []
    if not has_value_head(model):
        yield out
        return

    def hook(module, args):
        out.append(model.value_head(args[0]).squeeze(-1).float())

    handle = model.output.register_forward_pre_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def scored_values(head: list[torch.Tensor], which: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, shape) -> torch.Tensor | None:
    """The values `head_values` gave for one forward, laid out as the trainer lays out log-probs (scoring.py
    `scored_positions`): [episodes, width], column j the state before position j + 1. None without a head."""
    if not head:
        return None
    values = torch.zeros(shape, device=head[0].device)
    values[slots, positions - 1] = head[0][which.to(head[0].device)]
    return values


@torch.no_grad()
def step_values(pieces, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B, T] V of the state before each trained token (0 elsewhere) from the trainer's scored pieces of this
    rank's episodes (`Trainer._scored_pieces`), every rank's rows summed in: under the weights before the step's
    update, the baseline its advantages are fixed with."""
    values = torch.zeros_like(mask)
    for episodes, _, _, width, _, v in pieces:
        values[episodes, 1 : width + 1] = v.float().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.to(device)
        dist.all_reduce(values)
    return values.cpu()
