"""TorchStore, the control plane of weight sync: each version's handle (or, with the store transport, its state
dict) under `{prefix}/v{version}`, so a generator asks for exactly the version it is told to load and old
versions can be dropped. Works from any process of the Monarch job: torchstore finds its controller by name.
"""

from __future__ import annotations

import asyncio
import re

import torch
import torchstore

import forge_rl.compat.torchstore  # noqa: F401  (torchstore 0.1.2's actors, made spawnable on Monarch 0.7)

_started = False


async def start() -> None:
    """Start TorchStore (one storage volume on its own proc). Call once, on the controller, before put/get."""
    global _started
    if not _started:
        await torchstore.initialize()
        _started = True


async def stop() -> None:
    global _started
    if _started:
        await torchstore.shutdown()
        _started = False


def version_key(version: int, prefix: str = "policy") -> str:
    return f"{prefix}/v{version}"


async def put_state_dict(state_dict: dict[str, torch.Tensor], version: int, prefix: str = "policy") -> None:
    """Store `state_dict` (plain tensors, any dtype) under `{prefix}/v{version}`; values are copied, bit-exact."""
    await torchstore.put_state_dict(state_dict, version_key(version, prefix))


async def get_state_dict(version: int, prefix: str = "policy") -> dict[str, torch.Tensor]:
    """Fetch the state dict stored under `{prefix}/v{version}`. KeyError if that version is not there."""
    key = version_key(version, prefix)
    try:
        return await torchstore.get_state_dict(key)
    except RuntimeError as e:  # torchstore 0.1.2: "Mapping is missing from the store"
        raise KeyError(f"no weights stored under {key!r} (present: {await list_versions(prefix)})") from e


async def put_handle(handle: dict, version: int, prefix: str = "policy") -> None:
    """Store a version's WeightsHandle (layout.py, as a dict) under `{prefix}/v{version}/handle`."""
    await torchstore.put(version_key(version, prefix) + "/handle", handle)


async def get_handle(version: int, prefix: str = "policy") -> dict | None:
    """The WeightsHandle dict of `version`, or None when only a state dict was put (or nothing)."""
    try:
        return await torchstore.get(version_key(version, prefix) + "/handle")
    except KeyError:  # torchstore 0.1.2: a missing key fails its volume lookup with KeyError
        return None


async def list_versions(prefix: str = "policy") -> list[int]:
    """Versions present under `prefix`, ascending."""
    pattern = re.compile(rf"^{re.escape(prefix)}/v(\d+)/")
    keys = await torchstore.keys()  # 0.1.2's prefix filter returns nothing for any prefix: filter here
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


async def delete_version(version: int, prefix: str = "policy") -> None:
    """Remove every tensor of `{prefix}/v{version}` from the store (a no-op if it is absent)."""
    start = version_key(version, prefix) + "/"
    keys = [k for k in await torchstore.keys() if k.startswith(start)]
    await asyncio.gather(*(torchstore.delete(k) for k in keys))


async def latest_pushed_version(prefix: str = "policy") -> int:
    """The newest version whose handle is in TorchStore; 0 (the model directory) when none is.

    Not a promise that it can be loaded: its bytes may be still being written, dropped or overwritten; the
    reader asks again (engines/vllm/generator.py `catch_up`)."""
    for version in reversed(await list_versions(prefix)):
        if await get_handle(version, prefix) is not None:
            return version
    return 0
