"""Weight sync buffers and choices without engines: bit-exact round trips, refused torn or stale reads,
orphaned buffers of a killed writer removed. (The engines' side: tests/test_weight_sync_engines.py.)"""

import asyncio
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from forge_rl.weights import broadcast, layout, plan, shm
from forge_rl.runtime.provisioner import Host
from forge_rl.weights.shm import SharedBuffers
from forge_rl.weights.layout import StaleWeightsError, WeightsHandle


def make_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.rand(33, generator=g),  # odd byte length: the next tensor is realigned
        "lm_head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }


def read(handle: WeightsHandle) -> dict[str, torch.Tensor]:
    """What a reader does: views, copies, and the check after."""
    out = {name: view.clone() for name, view in shm.shared_views(handle)}
    shm.check_buffer(shm.map_buffer(handle.path), handle)
    return out


def assert_bit_exact(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.fixture
def buffers():
    b = SharedBuffers()
    yield b
    b.close()
    assert not any(os.path.exists(p) for p in b.paths)


def test_versions_alternate_between_two_buffers_and_read_back_bit_exact(buffers):
    handles = [buffers.write(make_state_dict(v), v) for v in (1, 2, 3)]
    assert [h.path for h in handles] == [buffers.paths[1], buffers.paths[0], buffers.paths[1]]
    assert_bit_exact(read(handles[1]), make_state_dict(2))
    assert_bit_exact(read(handles[2]), make_state_dict(3))
    assert all(offset % layout.ALIGN == 0 for *_, offset in handles[2].layout)


def test_fused_projections_are_one_block_of_the_buffer_in_vllm_row_order(buffers):
    """TorchTitan's HF names come gate, down, up; in the buffer gate|up (and q|k|v) must be adjacent, in that
    order, for a vLLM worker to pack them as one matrix without a copy."""
    g = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.k_proj", "self_attn.q_proj", "self_attn.q_norm", "self_attn.v_proj", "mlp.gate_proj",
        "mlp.down_proj", "mlp.up_proj")] + ["lm_head.weight"]
    state = {n: torch.randn(24, 16, generator=g) for n in names}
    ordered = layout.fused_order(state)
    assert sorted(ordered) == sorted(state) and all(ordered[n] is state[n] for n in state)  # no copies
    views = dict(shm.shared_views(buffers.write(ordered, 1)))
    for i in range(2):
        for group in layout.FUSED_PROJECTIONS:
            parts = [views[f"model.layers.{i}.{'self_attn' if 'q_proj' in group else 'mlp'}.{p}.weight"] for p in group]
            assert all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])), (i, group)
    assert list(ordered)[:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]


def test_a_half_written_buffer_is_refused(buffers):
    """The writer dies after part of the payload (its third tensor raises): the header was invalidated first,
    so neither the version that was there before nor any guess at the new one reads."""
    old = buffers.write(make_state_dict(1), 1)
    assert_bit_exact(read(old), make_state_dict(1))
    buffers.write(make_state_dict(2), 2)  # the other buffer; version 3 goes where version 1 was

    class DiesMidWrite(dict):
        def values(self):
            for i, v in enumerate(super().values()):
                if i == 2:
                    raise KeyboardInterrupt("writer killed")
                yield v

    with pytest.raises(KeyboardInterrupt):
        buffers.write(DiesMidWrite(make_state_dict(3)), 3)
    with pytest.raises(StaleWeightsError, match="being written"):
        read(old)
    guess = WeightsHandle(**{**old.as_dict(), "version": 3})
    with pytest.raises(StaleWeightsError, match="being written"):
        read(guess)


def test_a_read_overtaken_by_the_writer_is_refused_after_the_copy(buffers):
    handle = buffers.write(make_state_dict(1), 1)
    views = shm.shared_views(handle)
    first = next(views)[1].clone()  # the reader has started copying ...
    buffers.write(make_state_dict(2), 2)
    buffers.write(make_state_dict(3), 3)  # ... when the writer comes round to its buffer again
    rest = [v.clone() for _, v in views]
    assert len(rest) == 3 and first.numel()
    with pytest.raises(StaleWeightsError, match="holding version 3, not version 1"):
        shm.check_buffer(shm.map_buffer(handle.path), handle)


def test_the_writer_waits_for_a_reader_holding_its_buffer(buffers, monkeypatch):
    """A vLLM worker holds a shared lock on the buffer it loads from until it stops reading it (it serves from
    it until repacked): the trainer's write of version v+2 over it waits, and past the timeout gives up with
    version v intact."""
    old = buffers.write(make_state_dict(1), 1)
    buffers.write(make_state_dict(2), 2)
    lock = shm.lock_for_reading(old.path)
    writer = threading.Thread(target=buffers.write, args=(make_state_dict(3), 3))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive()  # waiting for the reader
    assert_bit_exact(read(old), make_state_dict(1))
    os.close(lock)
    writer.join(10)
    assert not writer.is_alive()
    with pytest.raises(StaleWeightsError, match="holding version 3, not version 1"):
        read(old)

    monkeypatch.setattr(shm, "READERS_TIMEOUT_S", 0.2)
    lock = shm.lock_for_reading(old.path)
    try:
        with pytest.raises(RuntimeError, match="still being loaded by a generator after 0.2 s: not overwritten"):
            buffers.write(make_state_dict(5), 5)
        assert_bit_exact(read(WeightsHandle(**{**old.as_dict(), **buffers_header(old.path)})), make_state_dict(3))
    finally:
        os.close(lock)


def buffers_header(path: str) -> dict:
    token, version, _ = shm.map_buffer(path)[: shm.HEADER_BYTES].view(torch.int64)[:3].tolist()
    return {"token": token, "version": version}


def test_a_reader_refuses_a_buffer_the_writer_holds(buffers):
    """The lock says it before the header does: a reader arriving mid-write does not get a shared lock."""
    buffers.write(make_state_dict(1), 1)
    midway, finish = threading.Event(), threading.Event()

    class SlowWrite(dict):
        def values(self):
            for i, v in enumerate(super().values()):
                if i == 2:
                    midway.set()
                    finish.wait(10)
                yield v

    writer = threading.Thread(target=buffers.write, args=(SlowWrite(make_state_dict(2)), 2))
    writer.start()
    try:
        assert midway.wait(10)
        with pytest.raises(StaleWeightsError, match="being written"):
            shm.lock_for_reading(buffers.paths[0])
    finally:
        finish.set()
        writer.join(10)
    os.close(shm.lock_for_reading(buffers.paths[0]))  # free again once written


def test_buffers_of_a_writer_killed_with_minus_9_are_removed_and_a_live_writers_are_not(buffers):
    mine = buffers.write(make_state_dict(1), 1)
    code = (
        "import os, sys, torch\n"
        "from forge_rl.weights.shm import SharedBuffers\n"
        "b = SharedBuffers(); b.write({'w': torch.ones(1000)}, 1)\n"
        "print(' '.join(b.paths), flush=True); sys.stdin.read()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    theirs = writer.stdout.readline().decode().split()
    assert len(theirs) == 2 and all(os.path.exists(p) for p in theirs)
    assert shm.remove_orphaned_buffers() == []  # its writer is alive
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    removed = shm.remove_orphaned_buffers()
    assert sorted(removed) == sorted(os.path.basename(p) for p in theirs)
    assert not any(os.path.exists(p) for p in theirs)
    assert_bit_exact(read(mine), make_state_dict(1))  # this process's buffers are untouched


def test_auto_picks_shared_memory_on_one_host_broadcast_across_hosts_and_the_fallback_when_it_must():
    """`plan` decides from where trainer rank 0 and each replica run (the provisioner's hosts)."""
    here, there = Host("127.0.0.2", "tcp://127.0.0.2:1", []), Host("127.0.0.3", "tcp://127.0.0.3:1", [])
    assert asyncio.run(plan.plan("auto", here, [here, here], 10**6)).kind == "shm"
    across = asyncio.run(plan.plan("auto", here, [here, there], 10**6))
    assert (across.kind, across.rendezvous, across.binds) == ("broadcast", "127.0.0.2", ["127.0.0.2", "127.0.0.3"])
    assert asyncio.run(plan.plan("auto", here, [here], 10**15)).kind == "store"  # /dev/shm cannot hold it
    assert asyncio.run(plan.plan("store", here, [there], 10**6)).kind == "store"
    assert asyncio.run(plan.plan("broadcast", here, [here], 10**6)).kind == "broadcast"
    with pytest.raises(ValueError, match="generator.weight_sync: shm needs the generators on the trainer's host 127.0.0.2, "
                                         "but some run on 127.0.0.3"):
        asyncio.run(plan.plan("shm", here, [here, there], 10**6))
    with pytest.raises(ValueError, match="generator.weight_sync"):
        asyncio.run(plan.plan("nccl", here, [here], 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: GPU tensors written into the host buffer")
def test_cuda_state_dicts_are_written_straight_into_the_buffer(buffers):
    handle = buffers.write({k: v.cuda() for k, v in make_state_dict(1).items()}, 1)
    assert_bit_exact(read(handle), make_state_dict(1))


def _broadcast_member(rank: int, port: int, bind: str, results) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    group = broadcast.join_group("127.0.0.2", port, rank, 2, bind, timeout_s=60)
    state_dict = make_state_dict(1)
    places, nbytes = layout.make_layout(state_dict)
    if rank == 0:
        broadcast.broadcast_send(group, 1, list(state_dict.values()))
    else:
        staging = broadcast.broadcast_receive(group, WeightsHandle("broadcast", 1, layout=places, nbytes=nbytes), None)
        results.put(as_bytes(dict(layout.tensor_views(staging, places))))


def as_bytes(state_dict: dict) -> dict[str, bytes]:
    """Raw bytes per tensor: what crosses a process boundary intact, and compares bit for bit."""
    return {k: v.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in state_dict.items()}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_a_broadcast_between_two_addresses_arrives_bit_exact():
    """Gloo on CPU (members bound to 127.0.0.2 and 127.0.0.3), NCCL when CUDA is present."""
    from forge_rl.core.net import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    members = [ctx.Process(target=_broadcast_member, args=(r, port, f"127.0.0.{2 + r}", results)) for r in (0, 1)]
    for m in members:
        m.start()
    received = results.get(timeout=300)  # two processes importing torch on a busy machine
    for m in members:
        m.join(timeout=60)
    assert [m.exitcode for m in members] == [0, 0]
    assert received == as_bytes(make_state_dict(1))
