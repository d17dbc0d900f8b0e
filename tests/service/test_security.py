"""Inbound security over real sockets: bearer tokens on gRPC, TLS and mutual TLS on both
ports (plaintext refused), certificate rotation without a restart, and a metrics port
that answers only /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rerank_client import AsyncRerankClient, RerankError
from rerank_client.cli import main as client_main

from rerank_server.api import healthcheck
from rerank_server.http_api import server as http_server_module
from rerank_server.managed.child_process import free_port
from rerank_server.security.tls import CertificateFiles
from rerank_server.server import RunningServer
from rerank_server.settings import Settings
from tests.conftest import StartServer, client_of
from tests.waiting import eventually

TOKEN = "grpc-token-0123456789abcdef"
DOCS = ["alpha", "beta", "gamma"]


async def test_grpc_needs_a_valid_token_but_health_stays_open(start_server: StartServer) -> None:
    server = await start_server(auth_tokens=f"other-token-0123456789,{TOKEN}")
    target = f"127.0.0.1:{server.port}"
    for token in (None, "wrong-token-0123456789abc", f"{TOKEN}x"):
        async with AsyncRerankClient(target, token=token) as client:
            with pytest.raises(RerankError) as info:
                await client.rerank("q", DOCS)
            assert info.value.code == "UNAUTHENTICATED"
    async with AsyncRerankClient(target, token=TOKEN) as client:
        assert (await client.rerank("q", DOCS)).reranked
    async with grpc.aio.insecure_channel(target) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in reflect:
                pass
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


def trusting(ca_file: Path, client: tuple[str, str] | None = None) -> ssl.SSLContext:
    """A client TLS context that trusts `ca_file` (and presents `client`, if given)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if client is not None:
        context.load_cert_chain(*client)
    return context


def _files(tmp: Path, ca: trustme.CA, name: str) -> tuple[str, str]:
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


@contextlib.asynccontextmanager
async def tls_server(
    start_server: StartServer,
    tmp: Path,
    *,
    mutual: bool = False,
) -> AsyncIterator[tuple[RunningServer, trustme.CA, Path]]:
    ca = trustme.CA()
    cert, key = _files(tmp, ca, "server")
    ca_file = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = await start_server(
        tls_cert=cert,
        tls_key=key,
        http_port=free_port(),
        tls_client_ca=str(ca_file) if mutual else "",
    )
    yield server, ca, ca_file


async def test_tls_on_both_ports_and_plaintext_is_refused(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with tls_server(start_server, tmp_path) as (server, _ca, ca_file):
        target = f"127.0.0.1:{server.port}"
        async with AsyncRerankClient(target, tls_ca=str(ca_file)) as client:
            assert (await client.rerank("q", DOCS)).reranked
        async with AsyncRerankClient(target) as plaintext:
            with pytest.raises(RerankError) as info:
                await plaintext.rerank("q", DOCS, timeout=3)
            assert info.value.code == "UNAVAILABLE"
        body = {"query": "q", "documents": DOCS}
        async with httpx.AsyncClient(verify=trusting(ca_file)) as https:
            answer = await https.post(f"https://127.0.0.1:{server.http_port}/v1/rerank", json=body)
        assert answer.status_code == 200 and answer.json()["meta"]["reranked"]
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", json=body)


async def test_a_tls_handshake_that_never_comes_closes_the_connection(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the HTTP port with TLS, a client that connects and sends nothing is held to the
    head deadline too (asyncio's own handshake limit is 60 s, and such a connection is not
    yet counted against --max-connections); ordinary https is unaffected."""
    monkeypatch.setattr(http_server_module, "HEAD_TIMEOUT_S", 0.5)
    async with tls_server(start_server, tmp_path) as (server, _ca, ca_file):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing sent
        writer.close()
        async with httpx.AsyncClient(verify=trusting(ca_file)) as https:
            answer = await https.get(f"https://127.0.0.1:{server.http_port}/health")
        assert answer.status_code == 200


async def test_mutual_tls_needs_a_client_certificate(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with tls_server(start_server, tmp_path, mutual=True) as (server, ca, ca_file):
        client_cert, client_key = _files(tmp_path, ca, "client")
        target = f"127.0.0.1:{server.port}"
        async with AsyncRerankClient(target, tls_ca=str(ca_file)) as anonymous:
            with pytest.raises(RerankError):
                await anonymous.rerank("q", DOCS, timeout=3)
        async with AsyncRerankClient(
            target, tls_ca=str(ca_file), tls_cert=client_cert, tls_key=client_key
        ) as client:
            assert (await client.rerank("q", DOCS)).reranked
        url = f"https://127.0.0.1:{server.http_port}/v1/rerank"
        body = {"query": "q", "documents": DOCS}
        async with httpx.AsyncClient(verify=trusting(ca_file)) as anonymous_http:
            with pytest.raises(httpx.HTTPError):
                await anonymous_http.post(url, json=body)
        async with httpx.AsyncClient(verify=trusting(ca_file, (client_cert, client_key))) as https:
            assert (await https.post(url, json=body)).status_code == 200


async def test_grpc_certificate_is_replaced_without_a_restart(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with tls_server(start_server, tmp_path) as (server, _ca, ca_file):
        target = f"127.0.0.1:{server.port}"
        new_ca = trustme.CA()
        # As a cert-manager renewal does: new files at the same paths.
        _files(Path(server.settings.tls_cert).parent, new_ca, "server")
        new_ca_file = tmp_path / "new-ca.pem"
        new_ca.cert_pem.write_to_path(str(new_ca_file))
        async with AsyncRerankClient(target, tls_ca=str(new_ca_file)) as client:
            assert (await client.rerank("q", DOCS)).reranked
        async with AsyncRerankClient(target, tls_ca=str(ca_file)) as old:
            with pytest.raises(RerankError):
                await old.rerank("q", DOCS, timeout=3)


async def test_metrics_port_answers_only_metrics(
    server: RunningServer, client: AsyncRerankClient
) -> None:
    assert (await client.rerank("q", DOCS)).reranked  # something to report
    port = server.telemetry.metrics_port
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        metrics = await http.get("/metrics")
        elsewhere = [await http.get(path) for path in ("/", "/healthz", "/metrics/x")]
    assert metrics.status_code == 200 and "rpc_server_call_duration" in metrics.text
    assert [r.status_code for r in elsewhere] == [404, 404, 404]


async def test_healthcheck_command_speaks_tls(start_server: StartServer, tmp_path: Path) -> None:
    async with tls_server(start_server, tmp_path) as (server, _ca, ca_file):
        port = str(server.port)
        secure = await asyncio.to_thread(
            healthcheck.main,
            ["--port", port, "--tls-ca", str(ca_file), "--server-name", "localhost"],
        )
        plaintext = await asyncio.to_thread(healthcheck.main, ["--port", port])
    assert (secure, plaintext) == (0, 1)


def test_backend_api_key_replaces_the_old_name() -> None:
    assert Settings(api_key="old").outbound_key == "old"  # still works, with a warning
    assert Settings(api_key="old", backend_api_key="new").outbound_key == "new"


async def test_http_certificate_is_replaced_without_a_restart(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with tls_server(start_server, tmp_path) as (server, _ca, _ca_file):
        new_ca = trustme.CA()
        _files(Path(server.settings.tls_cert).parent, new_ca, "server")
        new_ca_file = tmp_path / "new-ca.pem"
        new_ca.cert_pem.write_to_path(str(new_ca_file))
        url = f"https://127.0.0.1:{server.http_port}/health"

        async def new_certificate_served() -> bool:
            try:
                async with httpx.AsyncClient(verify=trusting(new_ca_file)) as https:
                    await https.get(url)
            except httpx.HTTPError:
                return False
            return True

        assert await eventually(new_certificate_served, 8, poll_s=0.5)  # checked every 5 s


async def test_a_broken_certificate_file_keeps_the_old_one_in_use(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with tls_server(start_server, tmp_path) as (server, _ca, ca_file):
        cert = Path(server.settings.tls_cert)
        await asyncio.to_thread(cert.write_text, "-----BEGIN CERTIFICATE-----\nbroken\n")
        await asyncio.sleep(6)  # past the HTTP reload check (every 5 s)
        async with httpx.AsyncClient(verify=trusting(ca_file)) as https:
            health = await https.get(f"https://127.0.0.1:{server.http_port}/health")
        async with client_of(server, tls_ca=str(ca_file)) as client:
            answer = await client.rerank("q", DOCS)
    assert health.status_code in (200, 503) and answer.reranked


async def test_rerank_client_cli_sends_its_token_over_tls(
    start_server: StartServer, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert, key = _files(tmp_path, ca, "server")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = await start_server(tls_cert=cert, tls_key=key, auth_tokens=TOKEN)
    argv = [
        "--target",
        f"127.0.0.1:{server.port}",
        "--tls-ca",
        str(ca_file),
        "--json",
        "q",
        "alpha",
        "beta",
        "gamma",
    ]
    assert await asyncio.to_thread(client_main, ["--token", TOKEN, *argv]) == 0
    assert await asyncio.to_thread(client_main, argv) != 0  # no token: refused


def test_a_certificate_replaced_while_it_was_read_is_read_again(tmp_path: Path) -> None:
    """The times a reload marks as seen are those from before it read the files: a file
    replaced during the read still counts as changed. (They were taken after the read,
    and such a replacement went unnoticed until the next one.)"""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("old")
    key.write_text("old")
    files = CertificateFiles.from_paths(str(cert), str(key))
    assert files is not None and files.changed() is None
    cert.write_text("new")
    times = files.changed()
    assert times is not None
    files.read()  # the reload reads the files ...
    cert.write_text("newer")  # ... and meanwhile they are replaced again
    os.utime(cert, ns=(times[0] + 1_000_000, times[0] + 1_000_000))
    files.loaded(times)
    assert files.changed() is not None
