"""deploy/ and docker-compose.yml, validated offline (no Docker engine, no cluster here).

Compose: the compose-spec JSON schema that check-jsonschema ships. Kubernetes: kubernetes-validate's
schemas (strict: unknown fields fail). KEDA ScaledObject: the CRD's openAPIV3Schema vendored in
tests/schemas/, made strict the same way.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.broker import queue_keys
from pipeline.config import Settings
from pipeline.config.celery import prefetch_multiplier, worker_profile

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
K8S = ROOT / "deploy" / "k8s"
SCRIPTS = sorted(p.name for p in DOCKER.glob("start-*"))
LONG_TASK_QUEUES = {"pdf", "transcode"}
SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|DSN|AUTH|KEY|REDIS_URL")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, doc) for p in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(p.read_text()) if doc]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def image_binaries() -> set[str]:
    """Executables `pip install .` puts on the image's PATH: our console scripts and our dependencies' we use."""
    project = pyproject()["project"]
    deps = {re.split(r"[\[<>=; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    provided = set(project["scripts"])
    provided |= {name for name in ("celery", "uvicorn") if name in deps}
    return provided


# --- Docker image and start scripts -----------------------------------------------------------


def test_dockerfile_is_one_non_root_image_with_ffmpeg_and_every_script() -> None:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())  # join continued lines
    assert len(re.findall(r"^FROM ", text, re.M)) == 1
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in ("0", "root")
    assert re.search(r"^RUN .*apt-get install .*\bffmpeg\b", text, re.M)
    copied = re.search(r"^COPY (deploy/docker/start-.*)$", text, re.M)
    assert copied
    sources = copied.group(1).split()
    assert sources[-1] == "/usr/local/bin/"
    assert sorted(Path(s).name for s in sources[:-1]) == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_start_script_is_short_execs_and_remaps_sigterm(script: str) -> None:
    path = DOCKER / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    assert subprocess.run(["sh", "-n", str(path)], check=False).returncode == 0
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) <= 3, lines
    assert "REMAP_SIGTERM=SIGQUIT" in lines[0]
    assert lines[-1].startswith("exec "), "the process must replace the shell to receive signals"
    binary = lines[-1].split()[1]
    assert binary in image_binaries(), f"{script} runs {binary!r}, which the image does not install"
    if script.startswith("start-worker"):
        assert "PROMETHEUS_MULTIPROC_DIR" in lines[0]
        assert "rm -f" in lines[1], "the metrics directory is wiped before Python starts"


def test_worker_profiles() -> None:
    io = (DOCKER / "start-worker-io").read_text()
    cpu = (DOCKER / "start-worker-cpu").read_text()
    # asyncio-pool workers under one supervisor (WORKER_POOL=solo: the solo ones); WORKER_PROCESSES unset or empty:
    # its default (one per CPU, plus one)
    assert 'exec pipeline worker --pool "${WORKER_POOL:-asyncio}" ${WORKER_PROCESSES:+--processes' in io
    assert "email,webhooks" in io
    assert "-P prefork" in cpu
    assert "pdf,transcode" in cpu
    # The prefetch follows the queues (WORKER_PROFILE=auto): long for pdf/transcode, short for the rest.
    settings = Settings(_env_file=None)
    assert worker_profile(settings, ["pdf", "transcode"]) == "long"
    assert prefetch_multiplier(settings, "long") == 1
    assert worker_profile(settings, ["default", "email", "webhooks"]) == "short"
    assert prefetch_multiplier(settings, "short") >= 4


# --- docker-compose.yml ---------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification() -> None:
    exe = shutil.which("check-jsonschema") or str(Path(os.sys.executable).parent / "check-jsonschema")
    done = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_services_and_redis_durability() -> None:
    services = compose()["services"]
    assert set(services) >= {
        "redis",
        "worker-io",
        "worker-cpu",
        "beat",
        "flower",
        "api",
        "exporter",
        "prometheus",
        "grafana",
        "redis-exporter",
    }
    redis_args = " ".join(services["redis"]["command"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction", "--requirepass"):
        assert flag in redis_args
    assert services["beat"]["deploy"]["replicas"] == 2
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]


def test_every_pipeline_service_runs_something_the_image_provides() -> None:
    for name, service in compose()["services"].items():
        if service.get("image") != "pipeline:latest":
            continue
        command = service["command"]
        assert command[0] in SCRIPTS, f"{name}: {command[0]!r} is not a start script of the image"


def test_compose_grace_exceeds_soft_shutdown() -> None:
    soft = Settings.model_fields["worker_soft_shutdown_timeout"].default
    for name in ("worker-io", "worker-cpu"):
        grace = compose()["services"][name]["stop_grace_period"]
        assert int(grace.rstrip("s")) > soft + 10


# --- Kubernetes -----------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as kubernetes-validate's strict schemas do (the API server would drop them)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


KEDA_SCHEMA = _strict(json.loads((ROOT / "tests" / "schemas" / "keda.sh_scaledobjects.v1alpha1.json").read_text()))


@pytest.mark.parametrize(("source", "doc"), manifests(), ids=lambda v: v if isinstance(v, str) else v.get("kind"))
def test_manifest_is_valid(source: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(doc, KEDA_SCHEMA)
    else:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_keda_schema_rejects_a_typo() -> None:
    doc = next(d for _, d in manifests() if d["kind"] == "ScaledObject")
    broken = copy.deepcopy(doc)
    broken["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, KEDA_SCHEMA)


def _containers() -> list[tuple[str, dict[str, Any]]]:
    return [
        (doc["metadata"]["name"], c)
        for _, doc in manifests()
        if doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"]["containers"]
    ]


def test_secrets_are_referenced_never_inlined() -> None:
    assert not [d for _, d in manifests() if d["kind"] == "Secret"]
    for _, doc in manifests():
        if doc["kind"] == "ConfigMap":
            assert not [k for k in doc["data"] if SECRETISH.search(k) and k != "REDIS_ADDRESS"], doc["data"]
    for name, container in _containers():
        for env in container.get("env", []):
            if SECRETISH.search(env["name"]):
                assert "secretKeyRef" in env.get("valueFrom", {}), f"{name}: {env['name']} must come from a Secret"


def test_every_deployment_runs_a_start_script_as_non_root() -> None:
    for _, doc in manifests():
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["command"][0] in SCRIPTS
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_workers_grace_periods_pdbs_and_autoscaling() -> None:
    docs = [d for _, d in manifests()]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    pdbs = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    default_soft = Settings.model_fields["worker_soft_shutdown_timeout"].default
    workers = {n: d for n, d in deployments.items() if n.startswith("worker-")}
    assert {"beat", "flower", "api", "exporter"} <= set(deployments)
    consumed: set[str] = set()
    for name, deployment in workers.items():
        pod = deployment["spec"]["template"]["spec"]
        env = _env(pod["containers"][0])
        soft = float(env.get("WORKER_SOFT_SHUTDOWN_TIMEOUT", default_soft))
        assert pod["terminationGracePeriodSeconds"] >= soft + 15, name
        assert name in pdbs, f"{name} has no PodDisruptionBudget"
        queue = env["WORKER_QUEUES"]
        consumed |= set(queue.split(","))
        if queue == "default":
            continue
        spec = scaled[name]["spec"]
        triggers = spec["triggers"]
        assert [t["metadata"]["listName"] for t in triggers] == queue_keys(queue), "every priority sub-queue counted"
        formula = spec["advanced"]["scalingModifiers"]["formula"]
        assert set(re.findall(r"[a-z_][a-z0-9_]*", formula)) == {t["name"] for t in triggers}
        if queue in LONG_TASK_QUEUES:
            assert spec["minReplicaCount"] >= 1, f"{queue}: never scale a long-task queue to zero"
    assert consumed >= {"default", "email", "pdf", "transcode", "webhooks"}
    assert "beat" in pdbs


def _node_prefix(script: str) -> str:
    """The node name (glob) a worker start script's workers have: `cpu` for `-n cpu@%h`, `io*` for the
    `pipeline worker --name io` supervisor's io1@%h..ioN@%h."""
    text = (DOCKER / script).read_text()
    match = re.search(r" -n (\S+)@%h ", text) or re.search(r"pipeline worker .*--name (\S+) ", text)
    assert match, f"{script} names no node"
    return match.group(1) + ("*" if "pipeline worker" in text else "")


def test_workers_liveness_is_the_stall_watchdog_probe_of_their_own_node() -> None:
    for _, doc in manifests():
        if doc["kind"] != "Deployment" or not doc["metadata"]["name"].startswith("worker-"):
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        probe = container["livenessProbe"]
        node = f"{_node_prefix(container['command'][0])}@%h"
        assert probe["exec"]["command"] == ["pipeline", "worker-health", "--node", node], doc["metadata"]["name"]
        # Probes several times per failure window, and tolerates a slow interpreter start.
        assert probe["timeoutSeconds"] >= 5 and probe["failureThreshold"] >= 2
    services = compose()["services"]
    for name in ("worker-io", "worker-cpu"):
        node = f"{_node_prefix(services[name]['command'][0])}@%h"
        assert services[name]["healthcheck"]["test"] == ["CMD", "pipeline", "worker-health", "--node", node]
