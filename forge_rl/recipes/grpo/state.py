"""Where a run is: what a checkpoint holds besides the trainer's own state (its DCP files)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RunState:
    """Owned by the training loop; saved beside every checkpoint (checkpoint.py) and restored on resume.
    Invariant: `version` is the policy version every generator serves once a step has returned."""

    step: int = 0  # train steps taken
    version: int = 0  # policy version pushed last (0: the model directory itself)
    next_seed: int = 0  # the seed of the next group to play

    def as_dict(self) -> dict:
        return asdict(self)
