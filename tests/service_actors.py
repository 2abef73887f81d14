"""Small real actors for the service tests (a module of their own so Monarch's processes can import them)."""

import asyncio
import os

from forge_rl.runtime.actor import ForgeActor
from forge_rl.runtime.service import ReplicaDead
from monarch.actor import concurrent_endpoint, endpoint


class EchoActor(ForgeActor):
    def __init__(self, tag: str, fail_setup_unless_first: str | None = None):
        self.tag = tag
        self.ready = False
        self.fail_setup_unless_first = fail_setup_unless_first  # a path: only the first replica's setup succeeds
        self.ping_mode = "answer"

    @endpoint
    async def setup(self):
        if self.fail_setup_unless_first is not None and not _first_to_create(self.fail_setup_unless_first, os.getpid()):
            raise RuntimeError("setup failed on purpose")
        self.ready = True

    @concurrent_endpoint
    async def ping(self) -> bool:
        if self.ping_mode == "hang":
            await asyncio.sleep(3600)
        if self.ping_mode == "raise":
            raise ValueError("ping failed on purpose")
        if self.ping_mode == "dead":  # as a Generator whose vLLM engine died
            raise ReplicaDead("its engine died, on purpose")
        return True

    @endpoint
    async def set_ping(self, mode: str) -> None:
        self.ping_mode = mode

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
    async def dead_engine_if_first(self, path: str) -> int:
        """As a Generator's call into an engine that died, for the first call (of any replica) given
        `path`: the process lives and the call raises ReplicaDead. Later calls return their pid."""
        if _first_to_create(path, os.getpid()):
            raise ReplicaDead("its engine died during the call, on purpose")
        return os.getpid()

    @endpoint
    async def die(self):
        os._exit(7)

    @endpoint
    async def die_if_first(self, path: str) -> int:
        """Exits if it is the first call (of any replica) given `path`; later calls return their pid."""
        if _first_to_create(path, os.getpid()):
            os._exit(7)
        return os.getpid()


class StoreReader(ForgeActor):
    """Reads weights from TorchStore in its own process, as a generator does."""

    @endpoint
    async def fetch(self, version: int) -> dict:
        from forge_rl.weights import control

        return await control.get_state_dict(version)


def _first_to_create(path: str, pid: int) -> bool:
    """Create `path` holding `pid` unless it exists: True for the one process that created it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(pid).encode())
    os.close(fd)
    return True
