"""`python -m forge_rl.envs module:Class --host --port`: serve any OpenEnv environment class.

openenv-core 0.3.0 imports gradio (about 3 s) for a web UI these servers never mount; a server
process skips it unless ENABLE_WEB_INTERFACE asks for that UI. Only this entry point does so,
never a library import.
"""

import os

from forge_rl.compat.openenv import skip_gradio

if os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() not in ("true", "1", "yes"):
    skip_gradio()

from forge_rl.envs import serve  # noqa: E402

serve()
