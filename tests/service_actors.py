"""Small real actors for the service tests (a module of their own so Monarch's processes can import them)."""

import asyncio
import os

from forge_rl.actor import ForgeActor
from monarch.actor import concurrent_endpoint, endpoint


class EchoActor(ForgeActor):
    def __init__(self, tag: str):
        self.tag = tag
        self.ready = False

    @endpoint
    async def setup(self):
        self.ready = True

    @endpoint
    async def whoami(self) -> tuple[str, int, bool]:
        return self.tag, os.getpid(), self.ready

    @endpoint
    async def env(self) -> dict:
        return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}

    @endpoint
    async def fail(self, message: str):
        raise ValueError(message)

    @concurrent_endpoint  # like a long generate(): other calls are served meanwhile
    async def hang(self):
        await asyncio.sleep(3600)

    @endpoint
    async def die(self):
        os._exit(7)


class StoreReader(ForgeActor):
    """Reads weights from TorchStore in its own process, as a generator does."""

    @endpoint
    async def fetch(self, version: int) -> dict:
        from forge_rl import store

        return await store.get_state_dict(version)
