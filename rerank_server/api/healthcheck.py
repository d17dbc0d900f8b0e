"""`rerank-server healthcheck`: ask a running server's gRPC health service, exit 0 or 1.

For container health checks (Docker's HEALTHCHECK, compose) where no gRPC probe exists.
It reads the same `RERANK_HOST`/`RERANK_PORT` as the server, so it needs no arguments
inside the server's container; a wildcard listen address is reached over loopback.
Kubernetes should use its native gRPC probes instead (deploy/kubernetes).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..settings import host_port

WILDCARDS = {"0.0.0.0", "::", ""}


def target(host: str, port: int) -> str:
    return host_port("127.0.0.1" if host in WILDCARDS else host, port)


def check(address: str, service: str, timeout_s: float) -> int:
    """0 when `service` is SERVING at `address`, else 1 (with the reason on stderr)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
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
    parser = argparse.ArgumentParser(prog="rerank-server healthcheck", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("RERANK_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("RERANK_PORT", "50051")))
    parser.add_argument("--service", default="rerank.v1.Reranker",
                        help="health service name ('' for the server as a whole)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    return check(target(args.host, args.port), args.service, args.timeout_s)
