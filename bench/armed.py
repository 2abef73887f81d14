"""Faults armed from outside a run, for bench/faults.py: a file named after the fault in $FORGE_RL_FAULTS_DIR,
taken once by the first call it concerns (bench/hostile_app.py in the run, bench/hostile_env.py in the server).
Standard library only: both virtualenvs import it."""

from __future__ import annotations

import os
import uuid


def arm(directory: str, fault: str) -> None:
    open(os.path.join(directory, fault), "w").close()


def take(fault: str) -> bool:
    """Whether `fault` is armed; the first caller takes it (a rename is atomic), later ones find nothing."""
    directory = os.environ.get("FORGE_RL_FAULTS_DIR")
    try:
        os.rename(os.path.join(directory, fault), os.path.join(directory, f"{fault}.taken.{uuid.uuid4().hex}"))
        return True
    except (TypeError, FileNotFoundError):
        return False


def taken(directory: str, fault: str) -> int:
    return sum(name.startswith(f"{fault}.taken.") for name in os.listdir(directory))
