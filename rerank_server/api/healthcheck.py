"""`rerank-server healthcheck`: ask a running server's gRPC health service, exit 0 or 1."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..settings import host_port

# The command's --help: what it is for, and when Kubernetes needs it.
DESCRIPTION = """\
`rerank-server healthcheck`: ask a running server's gRPC health service, exit 0 or 1.

For container health checks (Docker's HEALTHCHECK, compose) where no gRPC probe exists.
It reads the same `RERANK_HOST`/`RERANK_PORT` as the server, so it needs no arguments
inside the server's container; a wildcard listen address is reached over loopback.
Kubernetes should use its native gRPC probes instead (deploy/kubernetes), except with TLS:
kubelet's gRPC probes speak plaintext, so a TLS server is probed with this command and
`--tls-ca` (and `--tls-cert`/`--tls-key` under mutual TLS; `--server-name` when the
certificate does not name 127.0.0.1). Health needs no bearer token.
"""

WILDCARDS = {"0.0.0.0", "::", ""}


def target(host: str, port: int) -> str:
    return host_port("127.0.0.1" if host in WILDCARDS else host, port)


def _channel(address: str, ca: str, cert: str, key: str, server_name: str) -> grpc.Channel:
    if not ca:
        return grpc.insecure_channel(address)

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(
    address: str,
    service: str,
    timeout_s: float,
    *,
    ca: str = "",
    cert: str = "",
    key: str = "",
    server_name: str = "",
) -> int:
    """0 when `service` is SERVING at `address`, else 1 (with the reason on stderr)."""
    with _channel(address, ca, cert, key, server_name) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rerank-server healthcheck", description=DESCRIPTION)
    parser.add_argument("--host", default=os.environ.get("RERANK_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("RERANK_PORT", "50051")))
    parser.add_argument(
        "--service",
        default="rerank.v1.Reranker",
        help="health service name ('' for the server as a whole)",
    )
    parser.add_argument("--timeout-s", type=float, default=2.0)
    env = os.environ.get
    parser.add_argument(
        "--tls-ca",
        default=env("RERANK_HEALTHCHECK_CA", ""),
        help="PEM CA to verify a TLS server with (env RERANK_HEALTHCHECK_CA)",
    )
    parser.add_argument(
        "--tls-cert",
        default=env("RERANK_HEALTHCHECK_CERT", ""),
        help="client certificate under mutual TLS",
    )
    parser.add_argument(
        "--tls-key", default=env("RERANK_HEALTHCHECK_KEY", ""), help="client key under mutual TLS"
    )
    parser.add_argument(
        "--server-name",
        default=env("RERANK_HEALTHCHECK_SERVER_NAME", ""),
        help="name the server certificate carries, if not the address",
    )
    args = parser.parse_args(argv)
    return check(
        target(args.host, args.port),
        args.service,
        args.timeout_s,
        ca=args.tls_ca,
        cert=args.tls_cert,
        key=args.tls_key,
        server_name=args.server_name,
    )
