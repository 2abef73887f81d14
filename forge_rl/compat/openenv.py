"""openenv 0.10.0 internals, used by environment servers only (the server virtualenv; the training side
speaks the wire protocol itself, rollout/wire.py, and imports no openenv).

- `replace_route`: OpenEnv's /health still says only "healthy" (0.10: `HealthResponse(status=...)`); servers
  replace that route in the FastAPI app's route list, so probes and the run also read max_concurrent_envs.
- `skip_gradio`: `openenv.core.env_server` imports its web UI module, which imports gradio (seconds), when
  the package is imported, though no server here mounts that UI; a server process marks gradio absent
  before importing openenv, and 0.10 catches the ModuleNotFoundError.

The 0.3 client patches are gone with the client: forge_rl's own (wire.py) connects without compression or
proxy on loopback, closes by asking the server, and reads a capacity error that races the close.
"""

from __future__ import annotations

import sys

from forge_rl.compat import require

OPENENV_VERSION = "0.10.0"


def skip_gradio() -> None:
    sys.modules.setdefault("gradio", None)


def replace_route(app, path: str, handler, methods: list[str]) -> None:
    """Serve `path` with `handler` instead of the route the app already has there."""
    require("openenv", OPENENV_VERSION, __name__)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.add_api_route(path, handler, methods=methods)
