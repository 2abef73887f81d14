"""The multi-host objects of k8s/ (worker StatefulSets, the controller's RBAC, the Monarch NetworkPolicy)
fit together and fit what Monarch's KubernetesJob does, checked offline: cross-object checks on the
rendered base and overlays, then KubernetesJob's pod discovery against a stand-in of the pods watch
API whose pods (built from the rendered StatefulSets) point at local `forge_rl.worker` processes.
With KUBECONFIG reaching a real cluster, the API server itself judges `kubectl apply --dry-run=server`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.test_k8s import KUSTOMIZATIONS, NAMESPACE, ROOT, find, flag, job_config, kubectl, pod_spec, render
from tests.test_multihost import ENV, Workers

ROLES = ("trainer", "generator", "reference")


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def objects(request) -> list[dict]:
    return render(request.param)


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def pod_labels(workload) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def kubernetes_job_selector(role: str) -> tuple[str, str]:
    """(label selector, pod rank label) that Monarch's KubernetesJob.add_mesh uses for a mesh of pods."""
    from monarch._src.job.kubernetes import KubernetesJob

    job = object.__new__(KubernetesJob)  # its __init__ also sets Monarch's process-wide transport: skip it
    job._meshes = {}
    job.add_mesh(role, num_replicas=1)
    mesh = job._meshes[role]
    return mesh["label_selector"], mesh["pod_rank_label"]


def test_every_service_selects_pods_that_serve_its_ports(objects):
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [w for w in workloads(objects) if matches(service["spec"]["selector"], pod_labels(w))]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for workload in selected:
            ports = {p["name"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports, f"{service['metadata']['name']}: no port {port['targetPort']}"


@pytest.mark.parametrize("role", ROLES)
def test_worker_pods_are_the_ones_kubernetes_job_finds(objects, role):
    sts = find(objects, "StatefulSet", role)
    selector, rank_label = kubernetes_job_selector(role)
    wanted = dict(pair.split("=") for pair in selector.split(","))
    assert matches(wanted, pod_labels(sts)), f"{role} pods {pod_labels(sts)} miss KubernetesJob's {selector}"
    others = [o for o in workloads(objects) if o is not sts and matches(wanted, pod_labels(o))]
    assert not others, f"{selector} also selects {[o['metadata']['name'] for o in others]}"
    assert rank_label == "apps.kubernetes.io/pod-index"  # set on every pod of a StatefulSet (Kubernetes >= 1.28)
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert matches(sts["spec"]["selector"]["matchLabels"], pod_labels(sts))
    service = find(objects, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and matches(service["spec"]["selector"], pod_labels(sts))

    (worker,) = pod_spec(sts)["containers"]
    command, env = worker["command"], {e["name"]: e for e in worker["env"]}
    assert command[:3] == ["python", "-m", "forge_rl.worker"]
    # Dialled at tcp://<pod IP>:MONARCH_PORT by KubernetesJob; the worker serves there and says so.
    assert flag(command, "--host") == "$(POD_IP)" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    (port,) = worker["ports"]
    assert int(env["MONARCH_PORT"]["value"]) == int(flag(command, "--port")) == port["containerPort"]
    assert worker["readinessProbe"]["tcpSocket"]["port"] == port["name"]
    (controller,) = pod_spec(find(objects, "Job", "blackjack-grpo"))["containers"]
    assert worker["image"] == controller["image"]
    data = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "data")  # the model and checkpoints
    assert data["persistentVolumeClaim"]["claimName"] == "forge-rl-data"


def test_worker_pods_have_the_hosts_and_gpus_the_config_places_there(objects):
    cfg = job_config(objects)
    needs = {  # role -> (hosts, processes on each of its hosts)
        "trainer": (cfg.trainer.hosts, cfg.trainer.procs),
        "generator": (cfg.generator.hosts, cfg.generator.procs * math.ceil(cfg.generator.num_replicas / cfg.generator.hosts)),
    }
    if cfg.grpo.kl_coef > 0:
        needs["reference"] = (cfg.reference.hosts, math.ceil(cfg.reference.num_replicas / cfg.reference.hosts))
    on_gpus = cfg.model.dtype == "bfloat16"  # the GPU configs; the CPU one runs fp32
    for role, (hosts, procs) in needs.items():
        sts = find(objects, "StatefulSet", role)
        assert sts["spec"]["replicas"] == hosts, f"{role}: {sts['spec']['replicas']} pods, the config spans {hosts}"
        (worker,) = pod_spec(sts)["containers"]
        gpus = int(worker["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert gpus == (procs if on_gpus else 0), f"{role}: {gpus} GPUs per pod for {procs} procs"
    if "reference" not in needs:
        assert find(objects, "StatefulSet", "reference")["spec"]["replicas"] == 0  # no idle reference pods


def test_controller_may_watch_pods_and_nothing_more(objects):
    job = find(objects, "Job", "blackjack-grpo")
    spec = pod_spec(job)
    account = find(objects, "ServiceAccount", spec["serviceAccountName"])
    assert spec["automountServiceAccountToken"] is True  # KubernetesJob's in-cluster config reads the token
    assert account.get("automountServiceAccountToken") is False  # ... and no other pod gets it
    binding = next(o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["kind"] == "Role")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    role = find(objects, "Role", binding["roleRef"]["name"])
    # KubernetesJob (attach-only meshes) calls CoreV1Api.list_namespaced_pod with watch=True, and get.
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    for o in workloads(objects):
        if o is not job:
            assert pod_spec(o).get("automountServiceAccountToken") is False, o["metadata"]["name"]


def admitted(objects, source: dict, target: dict, port: int) -> bool:
    """Whether NetworkPolicy ingress lets a pod labelled `source` reach `target` on TCP `port`."""
    policies = [p for p in objects if p["kind"] == "NetworkPolicy" and matches(p["spec"]["podSelector"].get("matchLabels", {}), target)]
    policies = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]]
    if not policies:
        return True  # not isolated
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            by_source = peers is None or any(matches(peer.get("podSelector", {}).get("matchLabels", {}), source) for peer in peers if "podSelector" in peer)
            ports = rule.get("ports")
            by_port = ports is None or any(
                p.get("protocol", "TCP") == "TCP" and p.get("port", 1) <= port <= p.get("endPort", p.get("port", 65535)) for p in ports
            )
            if by_source and by_port:
                return True
    return False


def test_network_policy_lets_controller_and_workers_reach_each_other_on_any_port(objects):
    controller = pod_labels(find(objects, "Job", "blackjack-grpo"))
    workers = [pod_labels(find(objects, "StatefulSet", role)) for role in ROLES]
    for port in (26600, 1024, 40000, 65535):  # the worker port and ephemeral ones Monarch's procs open
        for worker in workers:
            assert admitted(objects, controller, worker, port) and admitted(objects, worker, controller, port)
            for other in workers:
                assert admitted(objects, worker, other, port)
    outsider = pod_labels(find(objects, "Deployment", "blackjack"))
    for target in [controller, *workers]:
        assert not admitted(objects, outsider, target, 26600), "pods outside the run must not reach Monarch"


class PodsAPI(ThreadingHTTPServer):
    """A stand-in of the Kubernetes pods watch API: answers a watch with one ADDED event per pod whose
    labels match the label selector, all Ready, then ends the stream."""

    def __init__(self, namespace: str, pods: list[dict]):
        self.namespace, self.pods, self.requests = namespace, pods, []
        super().__init__(("127.0.0.1", 0), PodsHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class PodsHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.requests.append((url.path, query))
        if url.path != f"/api/v1/namespaces/{self.server.namespace}/pods" or query.get("watch") not in ("true", "True"):
            self.send_error(404)
            return
        wanted = dict(pair.split("=") for pair in query.get("labelSelector", "").split(",") if pair)
        body = "".join(
            json.dumps({"type": "ADDED", "object": pod}) + "\n" for pod in self.server.pods if matches(wanted, pod["metadata"]["labels"])
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def pods_of(sts: dict, workers: list[str]) -> list[dict]:
    """The pods the StatefulSet controller would make, Ready, at the local workers' addresses."""
    pods = []
    for i, url in enumerate(workers):
        ip, port = url[len("tcp://") :].split(":")
        container = dict(pod_spec(sts)["containers"][0])
        container["env"] = [e for e in container["env"] if e["name"] != "MONARCH_PORT"] + [{"name": "MONARCH_PORT", "value": port}]
        pods.append({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{sts['metadata']['name']}-{i}",
                "namespace": sts["metadata"]["namespace"],
                "labels": {**pod_labels(sts), "apps.kubernetes.io/pod-index": str(i)},
            },
            "spec": {"containers": [container]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        })
    return pods


def test_kubernetes_job_finds_the_worker_pods_and_places_the_trainer_on_them(tmp_path):
    objects = render("k8s/overlays/cpu")  # trainer on two pods, generator on one
    workers = Workers(["127.0.0.2", "127.0.0.3", "127.0.0.4"], tmp_path)
    for url in workers.urls:  # what the kubelet's readiness probe does, before the controller attaches
        ip, port = url[len("tcp://") :].split(":")
        __import__("socket").create_connection((ip, int(port)), timeout=5).close()
    pods = pods_of(find(objects, "StatefulSet", "trainer"), workers.urls[:2])
    pods += pods_of(find(objects, "StatefulSet", "generator"), workers.urls[2:])
    api = PodsAPI(NAMESPACE, pods)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    try:
        out = subprocess.run(
            [sys.executable, "tests/kubernetes_discovery.py", api.url, NAMESPACE],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
        )
    finally:
        api.shutdown()
        workers.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hosts"] == {"trainer": workers.urls[:2], "generator": workers.urls[2:]}
    ranks = sorted((r["host"], r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"], r["MASTER_ADDR"]) for r in result["ranks"])
    assert ranks == [("127.0.0.2", "0", "2", "0", "127.0.0.2"), ("127.0.0.3", "1", "2", "0", "127.0.0.2")]
    selectors = {q["labelSelector"] for _, q in api.requests}
    assert selectors == {kubernetes_job_selector("trainer")[0], kubernetes_job_selector("generator")[0]}


def reachable_cluster() -> bool:
    if not os.environ.get("KUBECONFIG"):
        return False
    try:
        return subprocess.run([kubectl(), "version", "--request-timeout=5s"], capture_output=True, timeout=20).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


@pytest.mark.skipif(not reachable_cluster(), reason="needs KUBECONFIG pointing at a reachable Kubernetes cluster")
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_the_api_server_accepts_the_manifests(path):
    out = subprocess.run([kubectl(), "apply", "--dry-run=server", "-k", str(ROOT / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
