"""deploy/k8s/ (docs/kubernetes.md): every manifest is valid against the Kubernetes schemas (kubernetes-validate's
strict ones, shipped in its wheel: offline), so a misspelt field fails CI; and the manifests agree with the code they
deploy: the ports and probes the supervisor serves, a grace period that covers the drain of the config the pod runs,
the queue metric the engine exports, the cache folder the image names.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cosmos3_core.deployment import Deployment
from cosmos3_core.triton.launcher import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
VERSION = "1.30.0"  # the oldest release the manifests are meant for (autoscaling/v2, policy/v1 and the rest are older)


def manifests() -> list[dict]:
    docs = [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"no manifests in {K8S}"
    return docs


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in manifests() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_valid_against_the_schemas(doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_a_typo_fails():
    bad = copy.deepcopy(one("Deployment", "cosmos3"))
    spec = bad["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def _container() -> dict:
    (container,) = one("Deployment", "cosmos3")["spec"]["template"]["spec"]["containers"]
    return container


def _arg(container: dict, flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def test_probes_ports_and_gpu_match_the_server():
    c = _container()
    assert c["command"] == ["python3", "-m", "cosmos3_core.triton.serve"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}  # serve's defaults, which the args keep
    assert _arg(c, "--address") == "0.0.0.0"
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # one server per GPU
    for service in (d for d in manifests() if d["kind"] == "Service"):
        assert (
            service["spec"]["selector"].items() <= one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
        )
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_grace_period_covers_the_drain():
    """SIGTERM drains (serve.py): the pod must outlive preStop, the config's drain_timeout_s, the drain poll's 10 s
    more (serve.drain) and tritonserver's own exit timeout."""
    c = _container()
    deployment = Deployment.load(ROOT / _arg(c, "--config"))
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert "deployment.drain_timeout_s + 10" in (ROOT / "cosmos3_core/triton/serve.py").read_text()
    assert grace >= pause + deployment.drain_timeout_s + 10 + ServerConfig.exit_timeout_s


def test_volumes_hold_the_checkpoint_and_the_cache():
    c = _container()
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    checkpoint = Deployment.load(ROOT / _arg(c, "--config")).checkpoint
    assert any(checkpoint.startswith(path + "/") and m.get("readOnly") for path, m in mounts.items()), checkpoint
    cache = re.search(r"^ENV .*COSMOS3_CACHE=(\S+)", (ROOT / "docker/Dockerfile").read_text(), re.M).group(
        1
    )  # the served stage
    assert cache in mounts and "/dev/shm" in mounts
    assert _arg(c, "--workdir").startswith(tuple(mounts))
    claims = {d["metadata"]["name"] for d in manifests() if d["kind"] == "PersistentVolumeClaim"}
    volumes = one("Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v} <= claims


def test_autoscaler_reads_the_engine_queue():
    hpa = one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one("Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f'family("{name}",' in (ROOT / "cosmos3_core/triton/denoise.py").read_text()  # the gauge's real name
    rules = yaml.safe_load(one("ConfigMap", "prometheus-adapter-cosmos3")["data"]["config.yaml"])["rules"]
    assert any(rule["name"]["as"] == name and name in rule["seriesQuery"] for rule in rules)
