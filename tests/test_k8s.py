"""deploy/k8s (issue 13, 3): the kustomization renders as `kubectl kustomize` would, every resource
is valid against the Kubernetes schemas (offline, `kubernetes-validate`), and the pieces fit: names,
selectors, the image, probe ports and paths, secrets, and grace periods longer than the drains."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

BASE = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base"
# Kubernetes versions the manifests must be valid for: an old supported one and the newest known.
VERSIONS = ("1.30.0", "1.37.0")
# The kustomization fields render() implements; any other would make it diverge from kubectl.
KNOWN_FIELDS = {"apiVersion", "kind", "labels", "resources", "images"}
WORKER_DRAIN_S = 30  # the workers' --drain-timeout default


def render(base: Path = BASE) -> list[dict[str, Any]]:
    """kubectl kustomize for the fields this base uses: resource files, `labels` (metadata only,
    as without includeSelectors/includeTemplates) and `images` (name -> newName:newTag)."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(kustomization) <= KNOWN_FIELDS, set(kustomization) - KNOWN_FIELDS
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        path = base / name
        assert path.is_file(), f"kustomization lists {name}, which does not exist"
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in kustomization.get("labels", []):
        assert not entry.get("includeSelectors") and not entry.get("includeTemplates")
        for doc in out:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in kustomization.get("images", [])}
    for doc in out:
        for container in containers(doc):
            repo = image_repo(container["image"])
            if repo in images:
                container["image"] = images[repo]
    return out


def image_repo(image: str) -> str:
    """`registry:5000/x/baton:1.2@sha256:...` -> `registry:5000/x/baton` (what `images` matches)."""
    repo = image.split("@")[0]
    return repo.rsplit(":", 1)[0] if ":" in repo.rsplit("/", 1)[-1] else repo


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render()


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_is_valid_against_the_kubernetes_schemas(docs, version):
    from kubernetes_validate.utils import validate

    for doc in docs:
        validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_a_broken_manifest_is_caught():
    """The check above does check: an unknown field and a wrong type both fail."""
    from kubernetes_validate.utils import ValidationError, validate

    deployment = copy.deepcopy(by_kind(render(), "Deployment")["baton-gateway"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(ValidationError):
        validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(by_kind(render(), "Deployment")["baton-gateway"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(ValidationError):
        validate(deployment, VERSIONS[-1], strict=True)


def test_names_selectors_and_references_fit(docs):
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"baton-gateway", "baton-prefill", "baton-decode", "baton-redis"}
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two resources of one kind share a name"
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "baton" for d in docs)
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}

    def selects(selector: dict[str, str]) -> set[str]:
        return {name for name, labels in pods.items() if selector.items() <= labels.items()}

    for name, d in deployments.items():
        assert selects(d["spec"]["selector"]["matchLabels"]) == {name}, name
    for name, svc in by_kind(docs, "Service").items():
        [target] = selects(svc["spec"]["selector"])
        ports = {p["name"] for c in containers(deployments[target]) for p in c.get("ports", [])}
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"]), name
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert {target for pdb in pdbs.values() for target in selects(pdb["spec"]["selector"]["matchLabels"])} == {
        "baton-gateway", "baton-prefill", "baton-decode"}
    [hpa] = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "baton-decode"
    assert "replicas" not in deployments["baton-decode"]["spec"]  # the HPA owns it
    secrets = by_kind(docs, "Secret")
    redis_service = by_kind(docs, "Service")["baton-redis"]
    assert secrets["baton-redis"]["stringData"]["url"].startswith(
        f"redis://{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}/")
    for name, d in deployments.items():
        for c in containers(d):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (name, env["name"])


def test_baton_containers_run_the_image_with_probes_on_real_endpoints(docs):
    deployments = by_kind(docs, "Deployment")
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    [image] = kustomization["images"]
    probes = {}
    for name in ("baton-gateway", "baton-prefill", "baton-decode"):
        [c] = containers(deployments[name])
        assert c["image"] == f"{image['newName']}:{image['newTag']}", name
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[kind]["httpGet"]
            assert get["port"] in ports, (name, kind)
            probes[(name, kind)] = (get["path"], ports[get["port"]])
    assert probes[("baton-gateway", "readinessProbe")] == ("/ready", 8000)
    assert probes[("baton-gateway", "livenessProbe")] == ("/live", 8000)
    for name in ("baton-prefill", "baton-decode"):
        assert probes[(name, "readinessProbe")] == ("/health", 9100)
        assert probes[(name, "livenessProbe")] == ("/live", 9100)


def test_the_containers_arguments_parse_and_grace_periods_outlast_the_drains(docs, default_model_dir):
    from baton.worker.args import add_common_args
    from decode_worker.__main__ import _decode_args
    from gateway.__main__ import parse_args as gateway_args

    deployments = by_kind(docs, "Deployment")
    for kind in ("prefill", "decode"):
        d = deployments[f"baton-{kind}"]
        [c] = containers(d)
        assert c["command"] == ["python", "-m", f"{kind}_worker"]
        parser = argparse.ArgumentParser()
        add_common_args(parser, kind)
        if kind == "decode":
            _decode_args(parser)
        args = parser.parse_args(c["args"])  # an unknown or misspelt flag exits here
        assert args.metrics_port == 9100 and args.metrics_host == "0.0.0.0"
        assert args.drain_timeout >= WORKER_DRAIN_S
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout + 5
        cpu = c["resources"]["limits"]["cpu"]
        assert args.threads == int(cpu), "torch threads must match the CPU limit"
    gateway = deployments["baton-gateway"]
    [c] = containers(gateway)
    assert c["command"] == ["python", "-m", "gateway"]
    settings = gateway_args(c["args"])
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.shutdown_grace > WORKER_DRAIN_S  # a stream a draining worker finishes is delivered
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop + settings.shutdown_grace
