"""Shared memory on one host: the trainer writes each version into one of two /dev/shm buffers, every vLLM
worker on the host maps them once and loads from views of them.

No file, no pickling: one copy in, one copy out. The version's WeightsHandle (path, a random token, the layout)
goes to TorchStore; the buffer's header holds the token while its bytes are that version's.

Not `multiprocessing.shared_memory`: on Python < 3.13 every attaching process's resource tracker unlinks the
segment when that process exits. Plain /dev/shm files mapped with `torch.from_file` have no tracker; their
names carry the writer's pid, so `remove_orphaned_buffers` can delete those of a trainer killed with -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator

import psutil
import torch
import torch.distributed as dist

from forge_rl import weights as base
from forge_rl.weights import control
from forge_rl.weights.layout import StaleWeightsError, WeightsHandle, copy_rows, make_layout, tensor_views

SHM_DIR = "/dev/shm"
BUFFER_PREFIX = "forge_rl_wbuf_"  # then the writer's pid
HEADER_BYTES = 64  # int64 words: [0] token (0 while writing), [1] version, [2] payload bytes
READERS_TIMEOUT_S = 120.0  # how long the trainer waits for generators still loading from a buffer it must rewrite


class SharedBuffers:
    """The trainer's two shared-memory buffers; version v is written into buffer v % 2.

    Invariant: a buffer's header holds a handle's (token, version) only while its payload is exactly that
    version's bytes: the token is zeroed before the payload is touched and written last. Readers check the
    header before and after loading and refuse a mismatch (StaleWeightsError). A vLLM worker keeps reading
    after its update returned (worker.py, until repacked), so readers hold a shared flock (`lock_for_reading`)
    and the writer takes it exclusively before starting over a buffer, waiting up to READERS_TIMEOUT_S.
    """

    def __init__(self):
        self.paths: list[str] = []
        self.buffers: list[torch.Tensor] = []
        self.locks: list[int] = []  # an open file of each buffer, to flock
        self.nbytes = 0

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsHandle:
        """Copy `state_dict` into buffer version % 2 and return its handle (put it in TorchStore after)."""
        handle = self.claim(state_dict, version)
        self.fill(state_dict.values(), handle)
        return handle

    def claim(self, state_dict: dict[str, torch.Tensor], version: int, adapter: dict | None = None) -> WeightsHandle:
        """The handle of `version` once `fill` has written it; `state_dict`'s tensors may be meta."""
        layout, nbytes = make_layout(state_dict)
        if nbytes > self.nbytes:
            self._allocate(nbytes)
        token = secrets.randbits(62) + 1
        return WeightsHandle("shm", version, socket.gethostname(), self.paths[version % 2], token, layout, nbytes, adapter or {})

    def fill(self, tensors: Iterable[torch.Tensor], handle: WeightsHandle) -> None:
        """`tensors` in the claimed state dict's order."""
        payload, written = self.begin(handle), False
        try:  # one at a time: a sharded trainer gathers each as its turn comes
            copy_rows(payload, handle.layout, ((0, t) for t in tensors))
            written = True
        finally:
            self.end(handle, written)

    def begin(self, handle: WeightsHandle) -> torch.Tensor:
        """Lock the buffer once no reader holds it and invalidate its header; returns the payload. Then `end`."""
        slot = self.paths.index(handle.path)
        self._wait_for_readers(slot)
        self.buffers[slot][:HEADER_BYTES].view(torch.int64)[0] = 0
        return self.buffers[slot][HEADER_BYTES:]

    def end(self, handle: WeightsHandle, written: bool) -> None:
        """Unlock the buffer; if `written`, its header holds `handle` (the token last)."""
        slot = self.paths.index(handle.path)
        header = self.buffers[slot][:HEADER_BYTES].view(torch.int64)
        try:
            if written:
                header[1], header[2] = handle.version, handle.nbytes
                header[0] = handle.token
        finally:
            fcntl.flock(self.locks[slot], fcntl.LOCK_UN)

    def _wait_for_readers(self, slot: int) -> None:
        """Raise after READERS_TIMEOUT_S, leaving the version before last intact."""
        deadline = time.monotonic() + READERS_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.locks[slot], fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weight buffer {self.paths[slot]} is still being loaded by a generator after "
                                       f"{READERS_TIMEOUT_S:g} s: not overwritten (a stuck vLLM worker?)") from None
                time.sleep(0.001)

    def _allocate(self, nbytes: int) -> None:
        """Memory reserved now: a full /dev/shm fails here with ENOSPC, not later with SIGBUS on a write."""
        self.close()
        remove_orphaned_buffers()  # those of an earlier trainer killed before anyone swept them
        tag = f"{BUFFER_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        for slot in range(2):
            path = os.path.join(SHM_DIR, f"{tag}_{slot}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                self.close()
                raise OSError(e.errno, f"{SHM_DIR} has no room for two {nbytes / 1e6:.0f} MB weight buffers "
                              f"(set generator.weight_sync: store): {e.strerror}") from None
            self.locks.append(fd)
            self.paths.append(path)
            self.buffers.append(torch.from_file(path, shared=True, size=HEADER_BYTES + nbytes, dtype=torch.uint8))
        self.nbytes = nbytes

    def close(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for fd in self.locks:
            os.close(fd)
        self.paths, self.buffers, self.locks, self.nbytes = [], [], [], 0


_mapped: dict[str, torch.Tensor] = {}  # path -> the whole buffer, mapped once per reader process


def map_buffer(path: str) -> torch.Tensor:
    """The buffer at `path` as a shared uint8 tensor, mapped on first use and kept (at most the last two)."""
    if path not in _mapped:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise StaleWeightsError(f"weight buffer {path} is gone (its trainer stopped or reallocated it)") from None
        _mapped[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        while len(_mapped) > 2:
            _mapped.pop(next(iter(_mapped)))
    return _mapped[path]


def check_buffer(buffer: torch.Tensor, handle: WeightsHandle) -> None:
    """Raise StaleWeightsError unless `buffer`'s header holds exactly `handle`'s token and version."""
    token, version, nbytes = buffer[:HEADER_BYTES].view(torch.int64)[:3].tolist()
    if token != handle.token or version != handle.version or nbytes != handle.nbytes:
        state = "being written" if token == 0 else f"holding version {version}"
        raise StaleWeightsError(f"weight buffer {handle.path} is {state}, not version {handle.version}: refused")


def lock_for_reading(path: str) -> int:
    """A shared lock, held until the returned fd is closed; StaleWeightsError if the trainer is writing now."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StaleWeightsError(f"weight buffer {path} is gone (its trainer stopped or reallocated it)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StaleWeightsError(f"weight buffer {path} is being written: refused") from None
    return fd


def shared_views(handle: WeightsHandle) -> Iterator[tuple[str, torch.Tensor]]:
    """The reader must call `check_buffer` again after copying, and discard the copy if that raises."""
    buffer = map_buffer(handle.path)
    check_buffer(buffer, handle)
    return tensor_views(buffer[HEADER_BYTES:], handle.layout)


def remove_orphaned_buffers() -> list[str]:
    """Unlink the weight buffers whose writer process is gone (a trainer killed with -9); returns them."""
    removed = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        pid = name[len(BUFFER_PREFIX) :].split("_")[0]
        if name.startswith(BUFFER_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fits(nbytes: int, free_bytes: int) -> bool:
    """Whether a /dev/shm with `free_bytes` free holds both buffers of `nbytes` (a container's default is 64 MiB)."""
    return free_bytes > 2 * (HEADER_BYTES + nbytes)


class Publisher(base.Publisher):
    """Rank 0 puts the handle in TorchStore while it copies (early readers find another token) and leaves no
    handle when the copy fails. A sharded trainer all on this host skips the gather: every rank copies its own
    rows (`every_rank_writes`, decided once, collectively)."""

    def __init__(self, rank: int, world: int, device):
        self.rank, self.device = rank, device
        self.buffers = SharedBuffers()  # allocated on the first write
        self.every_rank_writes = False
        if world > 1:
            hosts = [None] * world
            dist.all_gather_object(hosts, socket.gethostname())
            self.every_rank_writes = len(set(hosts)) == 1

    async def publish(self, shapes: dict, tensors, version: int, rows: bool = False, adapter: dict | None = None,
                      receivers: list[int] | None = None) -> None:
        if rows:
            await self._write_own_rows(shapes, tensors, version)
        elif self.rank == 0:
            handle = self.buffers.claim(shapes, version, adapter)
            written, put = await asyncio.gather(asyncio.to_thread(self.buffers.fill, tensors, handle),
                                                control.put_handle(handle.as_dict(), version), return_exceptions=True)
            await settle_handle(version, written, put)

    async def _write_own_rows(self, shapes: dict, rows: Iterator, version: int) -> None:
        """Rank 0 locks the buffer before anyone writes and writes its header once an all-reduce says all rows
        are in; a failure anywhere leaves no handle and the header invalid."""
        handle, payload, error = None, None, None
        if self.rank == 0:
            try:  # no room in /dev/shm, or readers still hold the buffer: nobody writes, the old version stays
                handle = self.buffers.claim(shapes, version)
                payload = await asyncio.to_thread(self.buffers.begin, handle)
            except Exception as e:
                error = e
        path = [handle.path if payload is not None else None]
        dist.broadcast_object_list(path, src=0)
        if path[0] is None:
            if error is not None:
                raise error
            return
        put = asyncio.ensure_future(control.put_handle(handle.as_dict(), version)) if self.rank == 0 else None
        if payload is None:
            payload = map_buffer(path[0])[HEADER_BYTES:]
        try:
            await asyncio.to_thread(copy_rows, payload, make_layout(shapes)[0], rows)
        except Exception as e:
            error = e
        await asyncio.to_thread(drain, rows)  # the gathers left, after a failure here
        written = torch.tensor([error is None], dtype=torch.int32, device=self.device)
        dist.all_reduce(written, op=dist.ReduceOp.MIN)  # every rank's rows are in
        if error is None and not written:
            error = RuntimeError(f"weight version {version}: another trainer rank failed to write its rows into the buffer")
        if self.rank == 0:
            self.buffers.end(handle, written=error is None)
            (put,) = await asyncio.gather(put, return_exceptions=True)
            await settle_handle(version, error, put)
        elif error is not None:
            raise error

    def close(self) -> None:
        self.buffers.close()


async def settle_handle(version: int, written, put) -> None:
    """No record of a version whose bytes are not all there; raise what failed."""
    if isinstance(written, BaseException):
        if not isinstance(put, BaseException):
            await control.delete_version(version)
        raise written
    if isinstance(put, BaseException):
        raise put


def drain(tensors: Iterator) -> None:
    """Take what is left of a weights iterator (when sharded, each step is a gather all ranks join)."""
    for _ in tensors:
        pass


async def stage(version: int, handle: dict, engine, prefix: str) -> tuple[str, tuple, None]:
    """Refuse a wrong buffer before the engine is paused, while its weights are still intact."""
    if handle["host"] != socket.gethostname():
        raise RuntimeError(f"weights v{version} are in shared memory on {handle['host']}, not on this host "
                           f"({socket.gethostname()}): set generator.weight_sync to broadcast or store")
    check_buffer(map_buffer(handle["path"]), WeightsHandle(**handle))
    return "load_shared_weights", (handle,), None
