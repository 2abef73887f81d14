"""Run by tests/test_multihost.py in its own process (Monarch's transport is chosen once per process):
the same batch through a trainer spanning two workers (1 proc each) and one on this host (1 proc),
printing each rank's distributed environment and both trainers' metrics as one JSON line.

    python tests/multihost_trainer.py MODEL_DIR tcp://127.0.0.2:PORT tcp://127.0.0.3:PORT
"""

import asyncio
import json
import sys

from forge_rl.weights import control
from forge_rl.runtime.actor import stop
from forge_rl.core.config import ClusterConfig, GRPOConfig, OptimizerConfig
from forge_rl.core.objective import GRPOLoss
from forge_rl.runtime.provisioner import get_provisioner
from forge_rl.engines.titan.trainer import Trainer
from tests.test_trainer import make_batch
from tests.steps import plain_data

GRPO, OPTIM = GRPOConfig(loss_agg="token_mean"), OptimizerConfig(lr=1e-3)


async def main(model_dir: str, workers: list[str]) -> dict:
    await get_provisioner().use_cluster(ClusterConfig(workers=workers), {"trainer": 2})
    await control.start()
    two_hosts, one_host = await asyncio.gather(
        Trainer.options(procs=1, hosts=2, role="trainer").as_actor(model_dir, GRPOLoss(GRPO), OPTIM, micro_batch_size=2),
        Trainer.options(procs=1).as_actor(model_dir, GRPOLoss(GRPO), OPTIM, micro_batch_size=2),
    )
    try:
        batch = make_batch()
        result = {"ranks": [w for _, w in (await two_hosts._bind_rank.call()).items()], "two_hosts": [], "one_host": []}
        for _ in range(2):
            data = plain_data(GRPOLoss(GRPO), batch)
            result["two_hosts"].append([m for _, m in (await two_hosts.train_step.call(batch, data)).items()])
            result["one_host"].append(await one_host.train_step.call_one(batch, data))
        return result
    finally:
        await asyncio.gather(stop(two_hosts), stop(one_host))
        await control.stop()
        await get_provisioner().stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2:]))), flush=True)
