"""Run by tests/test_k8s_cluster.py in its own process: the controller's side of cluster.kubernetes.

Monarch's KubernetesJob, in-cluster, finds the worker pods through the pods watch API at API_URL (the
test's stand-in; in a pod the ServiceAccount token and KUBERNETES_SERVICE_HOST say where the API is,
which is the one thing replaced here), attaches to them, and a mesh spanning the trainer's pods reports
its distributed environment. Prints one JSON line.

    python tests/kubernetes_discovery.py API_URL NAMESPACE
"""

import asyncio
import json
import sys

from kubernetes import client
from monarch._src.job.kubernetes import KubeConfig

from forge_rl.runtime.actor import ForgeActor, Launcher
from forge_rl.core.config import ClusterConfig, KubernetesConfig
from forge_rl.runtime.provisioner import get_provisioner


def use_api(api_url: str) -> None:
    def load(self) -> None:  # instead of the pod's service-account files
        configuration = client.Configuration()
        configuration.host = api_url
        client.Configuration.set_default(configuration)

    KubeConfig.load = load


async def main(namespace: str) -> dict:
    provisioner = get_provisioner()
    await provisioner.use_cluster(ClusterConfig(kubernetes=KubernetesConfig(namespace, timeout_s=60)), {"trainer": 2, "generator": 1})
    procs, actor = await Launcher(ForgeActor, procs=1, hosts=2, role="trainer").spawn_mesh()
    try:
        return {
            "hosts": {role: [h.worker for h in hosts] for role, (_, hosts) in provisioner.roles.items()},
            "ranks": [w for _, w in (await actor._bind_rank.call()).items()],
        }
    finally:
        await provisioner.stop_procs(procs)
        await provisioner.stop()


if __name__ == "__main__":
    use_api(sys.argv[1])
    print(json.dumps(asyncio.run(main(sys.argv[2]))), flush=True)
