"""deploy/k8s (issue 13, 3): the kustomization renders as `kubectl kustomize` would, every resource
is valid against the Kubernetes schemas (offline, `kubernetes-validate`), and the pieces fit: names,
selectors, the image, probe ports and paths, secrets, and grace periods longer than the drains."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

BASE = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base"
# Kubernetes versions the manifests must be valid for: an old supported one and the newest known.
VERSIONS = ("1.30.0", "1.37.0")
# The kustomization fields render() implements; any other would make it diverge from kubectl.
KNOWN_FIELDS = {"apiVersion", "kind", "labels", "resources", "images", "secretGenerator"}
WORKER_DRAIN_S = 30  # the workers' --drain-timeout default
# What the deploy step writes (README, kustomization.yaml); git-ignored, so a checkout lacks it.
PASSWORD_FILE = "redis-password.env"
STAND_IN_PASSWORD = secrets.token_hex(32)
STAND_INS = {PASSWORD_FILE: f"password={STAND_IN_PASSWORD}\n"}


def render(base: Path = BASE, stand_ins: dict[str, str] = STAND_INS) -> list[dict[str, Any]]:
    """kubectl kustomize for the fields this base uses: resource files, `secretGenerator` (envs
    and literals, into `data`, the name suffixed with a hash of the content and every
    secretKeyRef to it rewritten), `labels` (metadata only, as without
    includeSelectors/includeTemplates) and `images` (name -> newName:newTag). `stand_ins`: the
    content of generator files the checkout lacks (the password file the deploy step makes)."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(kustomization) <= KNOWN_FIELDS, set(kustomization) - KNOWN_FIELDS
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        path = base / name
        assert path.is_file(), f"kustomization lists {name}, which does not exist"
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    renamed = {}
    for generator in kustomization.get("secretGenerator", []):
        assert set(generator) <= {"name", "envs", "literals", "options"}, generator
        pairs: dict[str, str] = {}
        for env_file in generator.get("envs", []):
            path = base / env_file
            text = path.read_text() if path.is_file() else stand_ins[env_file]
            for line in text.splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    key, _, value = line.partition("=")
                    pairs[key.strip()] = value.strip()
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            pairs[key] = value
        data = {k: base64.b64encode(v.encode()).decode() for k, v in sorted(pairs.items())}
        suffix = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        renamed[generator["name"]] = f"{generator['name']}-{suffix}"
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
                    "metadata": {"name": renamed[generator["name"]],
                                 "labels": dict(generator.get("options", {}).get("labels", {}))}})
    for doc in out:
        for container in containers(doc):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] in renamed:
                    ref["name"] = renamed[ref["name"]]
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
    assert secret_value(redis_secret(docs), "url").startswith(
        f"redis://{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}/")
    for name, d in deployments.items():
        for c in containers(d):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in secrets[ref["name"]]["data"], (name, env["name"])


def redis_secret(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [secret] = [d for name, d in by_kind(docs, "Secret").items() if name.startswith("baton-redis-")]
    return secret


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet would give it (secretKeyRefs resolved)."""
    secrets_ = by_kind(docs, "Secret")
    env = {}
    for entry in container.get("env", []):
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref and not (ref.get("optional") and ref["name"] not in secrets_):
            env[entry["name"]] = secret_value(secrets_[ref["name"]], ref["key"])
        elif "value" in entry:
            env[entry["name"]] = entry["value"]
    return env


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
    from baton.worker.args import worker_parser
    from gateway.__main__ import parse_args as gateway_args

    deployments = by_kind(docs, "Deployment")
    for kind in ("prefill", "decode"):
        d = deployments[f"baton-{kind}"]
        [c] = containers(d)
        assert c["command"] == ["python", "-m", f"{kind}_worker"]
        args = worker_parser(kind).parse_args(c["args"])  # an unknown or misspelt flag exits here
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


# ---- issue 20 (6): Redis wants a generated password, and only Baton's pods reach it -------------

BATON_PODS = ("baton-gateway", "baton-prefill", "baton-decode")


def test_the_redis_password_is_generated_at_deploy_time_and_never_committed():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    [generator] = kustomization["secretGenerator"]
    assert generator["name"] == "baton-redis" and generator["envs"] == [PASSWORD_FILE]
    ignored = subprocess.run(["git", "check-ignore", "-q", str(BASE / PASSWORD_FILE)], cwd=BASE)
    assert ignored.returncode == 0, f"{PASSWORD_FILE} must be git-ignored: it holds the password"
    step = f'echo "password=$(openssl rand -hex 32)" > deploy/k8s/base/{PASSWORD_FILE}'
    readme = (BASE.parents[2] / "README.md").read_text().split("\n## Kubernetes", 1)[1].split("\n## ", 1)[0]
    assert step in readme and step in (BASE / "kustomization.yaml").read_text()
    secret = redis_secret(render())
    assert len(secret_value(secret, "password")) == 64  # what the step makes
    assert "@" not in secret_value(secret, "url")  # the URL holds no secret: the password travels apart


def test_every_baton_process_gets_the_redis_password_from_the_secret(docs):
    deployments = by_kind(docs, "Deployment")
    secret = redis_secret(docs)
    for name in BATON_PODS:
        [c] = containers(deployments[name])
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert refs["REDIS_URL"] == {"name": secret["metadata"]["name"], "key": "url"}, name
        assert refs["BATON_REDIS_PASSWORD"] == {"name": secret["metadata"]["name"], "key": "password"}, name
        env = container_env(docs, c)
        assert env["BATON_REDIS_PASSWORD"] == STAND_IN_PASSWORD
        assert STAND_IN_PASSWORD not in " ".join(c.get("command", []) + c.get("args", []))


def test_redis_runs_with_requirepass_from_the_secret(docs, tmp_path):
    """The Redis container's own command and probes, run here with the environment Kubernetes
    gives them (redis-server on a free port): it refuses clients without the password, the probe
    passes with it, and the password is on no command line."""
    from baton.cli.redis_server import find_redis_server, free_port

    try:
        real_server = find_redis_server()
    except FileNotFoundError:
        pytest.skip("no redis-server here")
    [c] = containers(by_kind(docs, "Deployment")["baton-redis"])
    env = container_env(docs, c)
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == STAND_IN_PASSWORD
    assert not any("$(" in arg for arg in c["command"] + c["args"])  # the shell expands, not the kubelet
    port = free_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Stand-ins on PATH: the same programs, on our port, recording their arguments.
    (bin_dir / "redis-server").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nexec {real_server} "$@" --port {port} --bind 127.0.0.1 '
        f'--dir {tmp_path}\n')
    real_cli = Path(real_server).with_name("redis-cli")
    (bin_dir / "redis-cli").write_text(f'#!/bin/sh\nexec {real_cli} -p {port} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    import redis

    proc = subprocess.Popen(c["command"] + c["args"], env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = redis.Redis(port=port, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                raise AssertionError("Redis answered without the password")
            except redis.AuthenticationError:
                break  # up, and refusing
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "redis did not start"
                time.sleep(0.1)
        assert redis.Redis(port=port, password=STAND_IN_PASSWORD).ping()
        config = redis.Redis(port=port, password=STAND_IN_PASSWORD).config_get("maxmemory*")
        assert (config["maxmemory"], config["maxmemory-policy"]) == (str(1536 << 20), "volatile-lru")
        for kind in ("readinessProbe", "livenessProbe"):
            probe = subprocess.run(c[kind]["exec"]["command"], env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                                   capture_output=True, text=True, timeout=10)
            assert probe.stdout.strip() == "PONG", (kind, probe.stdout, probe.stderr)
        assert STAND_IN_PASSWORD not in (tmp_path / "argv").read_text()
        assert STAND_IN_PASSWORD not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions); {} selects everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def admitted(docs, target: str, port: int, source: tuple[str, dict[str, str]], namespace: str = "baton") -> bool:
    """Whether NetworkPolicy lets a pod (namespace, labels) connect to `target`'s pods on `port`
    (the semantics of networking.k8s.io/v1 ingress; every policy is in `namespace`, as applied)."""
    pod = by_kind(docs, "Deployment")[target]["spec"]["template"]
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    policies = [p for p in by_kind(docs, "NetworkPolicy").values()
                if "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], pod["metadata"]["labels"])]
    if not policies:
        return True  # a pod no policy selects is open to all
    src_namespace, src_labels = source
    namespace_labels = {"kubernetes.io/metadata.name": src_namespace}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = [named.get(p["port"], p["port"]) for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "namespaceSelector" in peer:
                    ns_ok = _matches(peer["namespaceSelector"], namespace_labels)
                else:
                    ns_ok = src_namespace == namespace
                if ns_ok and _matches(peer.get("podSelector", {}), src_labels):
                    return True
    return False


def test_network_policies_admit_only_baton_to_redis_and_prometheus_to_the_workers(docs):
    deployments = by_kind(docs, "Deployment")
    pod = {name: ("baton", d["spec"]["template"]["metadata"]["labels"]) for name, d in deployments.items()}
    stranger = ("baton", {"app": "anything-else"})
    elsewhere = ("other", {"app.kubernetes.io/name": "baton", "app.kubernetes.io/component": "gateway"})
    prometheus = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    for name in BATON_PODS:
        assert admitted(docs, "baton-redis", 6379, pod[name]), name
    for source in (stranger, elsewhere, prometheus):
        assert not admitted(docs, "baton-redis", 6379, source), source
    assert not admitted(docs, "baton-redis", 6379, pod["baton-redis"])
    for worker in ("baton-prefill", "baton-decode"):
        assert admitted(docs, worker, 9100, prometheus), worker
        for source in (stranger, pod["baton-gateway"], pod["baton-decode"], pod["baton-prefill"]):
            assert not admitted(docs, worker, 9100, source), (worker, source)
        assert not admitted(docs, worker, 22, prometheus)
    for source in (stranger, elsewhere, prometheus, ("anywhere", {})):
        assert admitted(docs, "baton-gateway", 8000, source), source  # clients: the API (with a key)
    assert not admitted(docs, "baton-gateway", 9000, stranger)
    # Every pod of the base is selected by some policy: none is left open to all by mistake.
    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert any(_matches(p["spec"]["podSelector"], labels) for p in by_kind(docs, "NetworkPolicy").values()), name
