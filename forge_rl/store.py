"""TorchStore: where the trainer leaves each policy version's weights and the generators pick them up.

Weights are a plain state dict put under a versioned key, `{prefix}/v{version}` (TorchForge's convention),
so a generator asks for exactly the version it is told to load and old versions can be dropped.

Why a shim: torchstore 0.1.2's `Controller` actor mixes sync and async endpoints, which Monarch >= 0.2
refuses to spawn ("mixes both async and sync endpoints"). `_make_endpoints_async` re-declares each sync
endpoint as an async one with the same body before the first `initialize()`; nothing else is changed.
Remove the shim when torchstore ships a release built for current Monarch.

All functions work from any process of the Monarch job (controller or actor): torchstore finds its
controller actor by name.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re

import torch
import torchstore
from monarch._src.actor.endpoint import EndpointProperty
from monarch.actor import endpoint
from torchstore.controller import Controller
from torchstore.storage_volume import StorageVolume


def _make_endpoints_async(cls) -> None:
    """Replace every synchronous @endpoint of `cls` with an async endpoint running the same code."""
    for name, attr in list(vars(cls).items()):
        if isinstance(attr, EndpointProperty) and not inspect.iscoroutinefunction(attr._method):
            sync_method = attr._method

            @functools.wraps(sync_method)
            async def as_async(self, *args, _sync_method=sync_method, **kwargs):
                return _sync_method(self, *args, **kwargs)

            setattr(cls, name, endpoint(as_async))


_make_endpoints_async(Controller)
_make_endpoints_async(StorageVolume)

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
    """Store a version's WeightsHandle (forge_rl/weight_sync.py, as a dict) under `{prefix}/v{version}/handle`."""
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
