"""torchstore 0.1.2 on Monarch 0.7: its actors' synchronous endpoints re-declared as async ones.

torchstore 0.1.2's `Controller` and `StorageVolume` mix sync and async endpoints, which Monarch >= 0.2
refuses to spawn ("mixes both async and sync endpoints"). Each sync endpoint becomes an async one running
the same body (through Monarch's internal `EndpointProperty`), before the first `torchstore.initialize()`.
Drop this file when torchstore ships a release built for current Monarch.
"""

from __future__ import annotations

import functools
import inspect

from forge_rl.compat import require

require("torchstore", "0.1.2", __name__)
require("monarch", "0.7.0", __name__)

from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402
from monarch.actor import endpoint  # noqa: E402
from torchstore.controller import Controller  # noqa: E402
from torchstore.storage_volume import StorageVolume  # noqa: E402


def _make_endpoints_async(cls) -> None:
    for name, attr in list(vars(cls).items()):
        if isinstance(attr, EndpointProperty) and not inspect.iscoroutinefunction(attr._method):
            sync_method = attr._method

            @functools.wraps(sync_method)
            async def as_async(self, *args, _sync_method=sync_method, **kwargs):
                return _sync_method(self, *args, **kwargs)

            setattr(cls, name, endpoint(as_async))


_make_endpoints_async(Controller)
_make_endpoints_async(StorageVolume)
