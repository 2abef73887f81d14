"""Run by tests/test_multihost.py in its own process (Monarch's transport is chosen once per process):
weights across two hosts, placed and wired as `grpo.start` does. The trainer lands on the first worker
(127.0.0.2), a generator replica on the second (127.0.0.3, replica 1 of a generator spanning both);
`plan.plan` must pick the broadcast, with the addresses the hosts' agents report. Prints one
JSON line: the plan, greedy log-probs from the model files, after an all-zero update, and after the
trainer's broadcast of the same weights, and the addresses the gloo connections use on each side.

    python tests/multihost_weights.py MODEL_DIR tcp://127.0.0.2:PORT tcp://127.0.0.3:PORT
"""

import asyncio
import json
import sys
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from forge_rl.weights import control
from forge_rl.weights import broadcast, plan
from forge_rl.runtime.actor import stop
from forge_rl.core.config import ClusterConfig, GeneratorConfig
from forge_rl.engines.vllm.generator import Generator
from forge_rl.runtime.provisioner import get_provisioner
from forge_rl.engines.titan.trainer import Trainer

PROMPT = list(range(40, 60))
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


def addresses(pids: list[int]) -> list[str]:
    """Local addresses of the TCP connections and listeners of these processes and their children."""
    procs = [p for pid in pids for p in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True))]
    return sorted({c.laddr.ip for p in procs for c in p.net_connections("tcp")})


async def main(model_dir: str, workers: list[str]) -> dict:
    provisioner = get_provisioner()
    await provisioner.use_cluster(ClusterConfig(workers=workers), {"trainer": 1, "generator": 2})
    await control.start()
    trainer_host, generator_host = provisioner.host_of("trainer"), provisioner.host_of("generator", 1, 2)
    nbytes = (Path(model_dir) / "model.safetensors").stat().st_size
    sync = await plan.plan("auto", trainer_host, [generator_host], nbytes)
    config = GeneratorConfig(max_model_len=256, gpu_memory_utilization=0.01)
    launcher = Generator.options(procs=1, hosts=2, role="generator")
    (generator_procs, generator), trainer = await asyncio.gather(
        launcher.spawn_mesh(model_dir, "float32", config, seed=0, replica=1),
        Trainer.options(procs=1, role="trainer").as_actor(model_dir, weight_sync=sync.kind),
    )
    try:
        async def logprobs():
            return (await generator.generate.call_one(PROMPT, GREEDY))[0].logprobs

        result = {"plan": [sync.kind, sync.rendezvous, sync.binds], "original": await logprobs()}
        await broadcast.connect(
            trainer, [generator], 1, sync.rendezvous, sync.binds, [await sync.trainer_host.free_port()]
        )
        zeros = {k: torch.zeros_like(v) for k, v in load_file(Path(model_dir) / "model.safetensors").items()}
        await control.put_state_dict(zeros, 1)
        await generator.update_weights.call_one(1)
        result["zeros"] = await logprobs()
        await trainer.push_weights.call(2)
        result["handle_kind"] = (await control.get_handle(2))["kind"]
        await generator.update_weights.call_one(2)
        await generator.finish_loading.call_one()  # bit-exact needs the engine's own GEMM: repacking done
        result["broadcast"] = await logprobs()
        result["version"] = await generator.current_version.call_one()
        for name, actor in (("trainer", trainer), ("generator", generator)):
            where = await actor._bind_rank.call_one()
            result[f"{name}_where"], result[f"{name}_addresses"] = where["host"], addresses([int(where["pid"])])
        return result
    finally:
        await asyncio.gather(stop(trainer), provisioner.stop_procs(generator_procs), return_exceptions=True)
        await control.stop()
        await provisioner.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2:]))), flush=True)
