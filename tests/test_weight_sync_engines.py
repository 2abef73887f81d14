"""Weight sync end to end: real Trainer actors push, real vLLM Generators load, on the tiny model (CPU, fp32).

Every path is checked the same way: the generators first load an all-zero state dict (uniform log-probs),
then the trainer's weights through the path under test, after which greedy log-probs must equal those of
the engine started from the model files, bit for bit (a tensor lost or changed on the way shows), once the
engine's background repacking is done (`finish_loading`; before, it serves the same weights through F.linear).
The tests share the actors and run in file order; the last one kills the shared-memory trainer with -9.
"""

import asyncio
import glob
import math
import os
import signal
import socket
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file

from forge_rl.weights import control
from forge_rl.engines.vllm.cpu import KEEP_FREED_MEMORY
from forge_rl.weights import broadcast, layout, shm
from forge_rl.runtime.actor import stop
from forge_rl.core.config import GeneratorConfig
from forge_rl.engines.vllm.generator import Generator
from forge_rl.core.net import free_port
from forge_rl.models.tiny import build_tiny_model
from forge_rl.engines.titan.trainer import Trainer

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]  # the shared fixture starts two engines and two trainers
PROMPT = list(range(40, 60))
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


def trainer_buffers(trainer_pid: int) -> list[str]:
    """The buffers of one trainer (other runs on this host may have theirs in /dev/shm meanwhile)."""
    return glob.glob(os.path.join(shm.SHM_DIR, f"{shm.BUFFER_PREFIX}{trainer_pid}_*"))


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    """Two generator replicas, a trainer pushing through shared memory, one pushing by broadcast."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    loop = asyncio.new_event_loop()
    config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)

    async def start():
        await control.start()
        return await asyncio.gather(
            Generator.options(procs=1).as_actor(str(path), "float32", config, seed=0),
            Generator.options(procs=1).as_actor(str(path), "float32", config, seed=0),
            Trainer.options(procs=1).as_actor(str(path), weight_sync="shm"),
            Trainer.options(procs=1).as_actor(str(path), weight_sync="broadcast"),
        )

    one, two, shm_trainer, broadcast_trainer = loop.run_until_complete(start())
    ns = SimpleNamespace(run=loop.run_until_complete, path=path, generators=[one, two], shm_trainer=shm_trainer,
                         broadcast_trainer=broadcast_trainer, version=0)
    ns.original = [logprobs(ns, g) for g in ns.generators]
    try:
        yield ns
    finally:
        loop.run_until_complete(gather(*(stop(x) for x in (one, two, shm_trainer, broadcast_trainer)),
                                               return_exceptions=True))
        loop.run_until_complete(control.stop())
        loop.close()


async def gather(*coroutines, return_exceptions=False):
    return await asyncio.gather(*coroutines, return_exceptions=return_exceptions)


def logprobs(a, generator) -> list[float]:
    return a.run(generator.generate.call_one(PROMPT, GREEDY))[0].logprobs


def load_zeros(a, generators) -> None:
    """Through the TorchStore state-dict path (no handle: what older callers put)."""
    a.version += 1
    zeros = {k: torch.zeros_like(v) for k, v in load_file(a.path / "model.safetensors").items()}
    a.run(control.put_state_dict(zeros, a.version))
    a.run(gather(*(g.update_weights.call_one(a.version) for g in generators)))
    vocab = zeros["lm_head.weight"].shape[0]
    for g in generators:
        assert logprobs(a, g) == pytest.approx([-math.log(vocab)] * GREEDY["max_tokens"], abs=1e-5)


def pid(a, actor) -> int:
    return int(a.run(actor._bind_rank.call_one())["pid"])


def processes_mapping(path: str) -> set[int]:
    pids = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if path in f.read():
                    pids.add(int(maps.split("/")[2]))
        except OSError:
            pass
    return pids


def test_two_replicas_load_one_shared_buffer_bit_exact(a):
    assert a.original[0] == a.original[1]
    load_zeros(a, a.generators)
    a.version += 1
    a.run(a.shm_trainer.push_weights.call(a.version))
    handle = a.run(control.get_handle(a.version))
    assert handle["kind"] == "shm" and handle["host"] == socket.gethostname()
    a.run(gather(*(g.update_weights.call_one(a.version) for g in a.generators)))
    for g, original in zip(a.generators, a.original):
        assert logprobs(a, g) == pytest.approx(original, abs=1e-4)  # this version, whichever GEMM serves it
        a.run(g.finish_loading.call_one())
        assert logprobs(a, g) == original  # bit-exact
        assert a.run(g.current_version.call_one()) == a.version
    trainer_pid = pid(a, a.shm_trainer)
    assert len(trainer_buffers(trainer_pid)) == 2  # one pair, however many readers
    readers = processes_mapping(handle["path"]) - {trainer_pid}
    # each replica's vLLM worker and the Generator actor itself (its check before the gate)
    assert len(readers) >= 2, readers


def test_vllm_workers_run_with_the_malloc_settings_that_keep_freed_memory(a):
    """Set in the Generator's environment before vLLM spawns its engine processes, which read them at start."""
    handle = a.run(control.get_handle(a.version))
    workers = [p for p in map(psutil.Process, processes_mapping(handle["path"])) if p.name().startswith(("VLLM::Worker", "VLLM::EngineCore"))]
    assert len(workers) == 2, workers  # one per replica: its engine core, where one rank computes
    for worker in workers:
        with open(f"/proc/{worker.pid}/environ", "rb") as f:  # raw: setproctitle leaves NULs psutil stops at
            environment = set(f.read().decode(errors="replace").split("\0"))
        for name, value in KEEP_FREED_MEMORY.items():
            assert f"{name}={value}" in environment, (worker, name)


def test_the_engine_copies_the_buffer_it_loaded_from(a):
    """Zeroing the buffer once the load is done leaves the served weights alone (vLLM keeps no views of it)."""
    a.run(a.generators[0].finish_loading.call_one())
    handle = layout.WeightsHandle(**a.run(control.get_handle(a.version)))
    shm.map_buffer(handle.path)[shm.HEADER_BYTES :].zero_()
    assert logprobs(a, a.generators[0]) == a.original[0]
    a.run(a.shm_trainer.push_weights.call(a.version + 2))  # into the same buffer: version a.version is gone
    with pytest.raises(Exception, match=f"holding version {a.version + 2}, not version {a.version}"):
        a.run(a.generators[0].update_weights.call_one(a.version))
    assert a.run(a.generators[0].current_version.call_one()) == a.version  # refused before the load
    assert logprobs(a, a.generators[0]) == a.original[0]
    a.version += 2


def test_the_fallback_path_through_torchstore_state_dicts_is_bit_exact(a):
    """What the trainer with weight_sync=store puts: the state dict under policy/v{n} and a "store" handle."""
    load_zeros(a, a.generators[:1])
    a.version += 1
    original = load_file(a.path / "model.safetensors")
    a.run(control.put_state_dict(original, a.version))
    a.run(control.put_handle(layout.WeightsHandle("store", a.version).as_dict(), a.version))
    a.run(a.generators[0].update_weights.call_one(a.version))
    assert logprobs(a, a.generators[0]) == a.original[0]


def test_a_buffer_without_the_fused_blocks_loads_through_vllms_reload_bit_exact(a):
    """The model file's order (k_proj before q_proj, down_proj between gate_proj and up_proj) has no layer's
    weight as one block: the worker takes vLLM's reload_weights instead of packing from the buffer."""
    load_zeros(a, a.generators[:1])
    a.version += 1
    buffers = shm.SharedBuffers()
    try:
        handle = buffers.write(load_file(a.path / "model.safetensors"), a.version)
        a.run(control.put_handle(handle.as_dict(), a.version))
        a.run(a.generators[0].update_weights.call_one(a.version))
        assert logprobs(a, a.generators[0]) == a.original[0]
    finally:
        buffers.close()


def test_broadcast_between_two_host_addresses_is_bit_exact(a):
    """The trainer on 127.0.0.2 (its rendezvous too), the generator's vLLM worker on 127.0.0.3: gloo."""
    generator = a.generators[1]
    a.run(broadcast.connect(a.broadcast_trainer, [generator], 1, "127.0.0.2", ["127.0.0.3"], [free_port()]))
    load_zeros(a, [generator])
    a.version += 1
    a.run(a.broadcast_trainer.push_weights.call(a.version))
    assert a.run(control.get_handle(a.version))["kind"] == "broadcast"
    a.run(generator.update_weights.call_one(a.version))
    a.run(generator.finish_loading.call_one())
    assert logprobs(a, generator) == a.original[1]
    # gloo's pairs listen on their member's address: the trainer's on 127.0.0.2, the vLLM worker's on 127.0.0.3
    trainer = psutil.Process(pid(a, a.broadcast_trainer))
    assert "127.0.0.2" in {c.laddr.ip for c in trainer.net_connections("tcp") if c.raddr}
    engine = psutil.Process(pid(a, generator)).children(recursive=True)
    listening = {c.laddr.ip for p in engine for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert "127.0.0.3" in listening, listening


def test_nothing_left_in_dev_shm_after_the_trainer_is_killed_and_the_rest_stop(a):
    a.version += 1
    a.run(a.shm_trainer.push_weights.call(a.version))
    a.run(gather(*(g.update_weights.call_one(a.version) for g in a.generators)))
    trainer_pid = pid(a, a.shm_trainer)
    assert len(trainer_buffers(trainer_pid)) == 2
    os.kill(trainer_pid, signal.SIGKILL)
    a.run(gather(*(stop(g) for g in a.generators)))
    assert trainer_buffers(trainer_pid) == []
