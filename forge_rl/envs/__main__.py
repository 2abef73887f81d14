"""`python -m forge_rl.envs module:Class --host --port`: serve any OpenEnv environment class.

Runs in the server virtualenv (openenv 0.10.0; local.py `server_python`). openenv imports gradio
(seconds) for a web UI these servers never mount; a server process skips it unless ENABLE_WEB_INTERFACE
asks for that UI. Only this entry point does so, never a library import.
"""

import os

from forge_rl.compat.openenv import skip_gradio

if os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() not in ("true", "1", "yes"):
    skip_gradio()

from forge_rl.envs import serve  # noqa: E402

serve()
