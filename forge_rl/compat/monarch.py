"""Monarch 0.7 internals: the supervision error type, the process-wide fault hook, channel transports.

- `SupervisionError` is what a call to an actor whose processes died raises; Monarch exports it only
  from its Rust bindings.
- `install_fault_hook`: Monarch's default `unhandled_fault_hook` exits the controller when any process
  of any mesh dies; a service restarts its replicas instead, so the hook only records the failure.
- `channel_transport`: the `ChannelTransport` enum lives in the Rust bindings too.
"""

from __future__ import annotations

from forge_rl.compat import require

require("monarch", "0.7.0", __name__)

import monarch.actor  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # noqa: E402, F401


def install_fault_hook(hook) -> None:
    """`hook(failure: MeshFailure)` runs instead of Monarch's exit when a mesh's process dies."""
    monarch.actor.unhandled_fault_hook = hook


def channel_transport(name: str):
    """"hostname" or "localhost" -> Monarch's ChannelTransport."""
    return {"hostname": ChannelTransport.TcpWithHostname, "localhost": ChannelTransport.TcpWithLocalhost}[name]
