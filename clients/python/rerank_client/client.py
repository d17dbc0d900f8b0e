"""Async and sync clients for `rerank.v1.Reranker`.

Both take the same arguments and return the same typed values. Failed calls raise the
exceptions in `errors`; a degraded answer (scorer trouble on the server) is not an error:
check `answer.reranked` and `answer.summary.degraded_code`.

For a server behind a headless Kubernetes Service, pass `load_balancing="round_robin"` and
a `dns:///` target so calls spread over every pod instead of sticking to the first one.

Security: `token` is sent as `authorization: Bearer <token>` with every call (servers run
with `--auth-tokens`); `tls_ca` (a PEM file or bytes) turns on TLS and verifies the server
against that CA, and `tls_cert` + `tls_key` add a client certificate for mutual TLS.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from . import errors
from .pb import rerank_pb2_grpc as pb_grpc
from .types import CandidateLike, RerankAnswer, Result, Summary, build_request, stream_item

# Call metadata sent with a request, e.g. [("traceparent", "00-...-01")] to continue a trace.
Metadata = Sequence[tuple[str, str]]


def channel_options(load_balancing: str | None = None,
                    max_message_bytes: int = 16 * 1024 * 1024,
                    own_connection: bool = False) -> list[tuple[str, Any]]:
    """`own_connection`: this channel opens its own connections instead of sharing those of
    other channels to the same target in this process (grpc's default). A server's
    workers (`--workers`) and a pod's replicas behind a plain Service spread connections,
    not calls."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if load_balancing:
        config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
        options.append(("grpc.service_config", json.dumps(config)))
    return options


Pem = str | bytes | None  # a PEM file's path, or its bytes


def _pem(value: Pem) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def tls_credentials(tls_ca: Pem = None, tls_cert: Pem = None,
                    tls_key: Pem = None) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS (None when no CA is given: plaintext)."""
    if tls_ca is None:
        if tls_cert is not None or tls_key is not None:
            raise ValueError("tls_cert/tls_key need tls_ca: without a CA the channel would "
                             "be plaintext")
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca),
                                        private_key=_pem(tls_key),
                                        certificate_chain=_pem(tls_cert))


class _Calls:
    """What both clients share: the metadata every call carries."""

    def __init__(self, token: str | None) -> None:
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()

    def metadata(self, extra: Metadata | None) -> Metadata | None:
        if not self._auth:
            return extra
        return (*self._auth, *(extra or ()))


class AsyncRerankClient(_Calls):
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 load_balancing: str | None = None, token: str | None = None,
                 tls_ca: Pem = None, tls_cert: Pem = None, tls_key: Pem = None,
                 own_connection: bool = False) -> None:
        super().__init__(token)
        options = channel_options(load_balancing, own_connection=own_connection)
        credentials = credentials or tls_credentials(tls_ca, tls_cert, tls_key)
        self._channel = (grpc.aio.secure_channel(target, credentials, options=options)
                         if credentials else grpc.aio.insecure_channel(target, options=options))
        self._stub = pb_grpc.RerankerStub(self._channel)

    async def __aenter__(self) -> AsyncRerankClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def rerank(self, query: str, candidates: Iterable[CandidateLike] = (), *,
                     timeout: float | None = None, metadata: Metadata | None = None,
               **options: Any) -> RerankAnswer:
        """Rerank `candidates` for `query`. `options`: top_k, instruction, request_id,
        blend_strategy, max_candidates, max_chunk_chars, timeout_ms, return_text.
        `metadata` goes out with the call (a W3C `traceparent` continues your trace)."""
        request = build_request(query, candidates, **options)
        try:
            response = await self._stub.Rerank(request, timeout=timeout,
                                               metadata=self.metadata(metadata))
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return RerankAnswer.from_pb(response)

    async def stream(self, query: str, candidates: Iterable[CandidateLike] = (), *,
                     timeout: float | None = None, metadata: Metadata | None = None,
                     **options: Any,
                     ) -> AsyncIterator[Result | Summary]:
        """Results in final order as each becomes certain, then the `Summary`."""
        request = build_request(query, candidates, **options)
        call = self._stub.RerankStream(request, timeout=timeout, metadata=self.metadata(metadata))
        try:
            async for message in call:
                yield stream_item(message)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def rerank_many(self, queries: Mapping[str, tuple[str, Sequence[CandidateLike]]], *,
                          timeout: float | None = None, metadata: Metadata | None = None,
                          **options: Any,
                          ) -> AsyncIterator[tuple[str, RerankAnswer | errors.RerankError]]:
        """Many queries over one `RerankBatch` stream, keyed by request id.

        Yields `(request_id, answer)` as each completes, in completion order; a request
        the server rejected yields its `RerankError` instead of an answer.
        """
        requests = [build_request(q, c, request_id=rid, **options)
                    for rid, (q, c) in queries.items()]
        call = self._stub.RerankBatch(iter(requests), timeout=timeout,
                                      metadata=self.metadata(metadata))
        try:
            async for response in call:
                if response.HasField("error"):
                    yield response.request_id, errors.from_batch_error(response.error)
                else:
                    yield response.request_id, RerankAnswer.from_pb(response)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None


class RerankClient(_Calls):
    """Blocking client over a plain grpc channel; usable from any thread."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 load_balancing: str | None = None, token: str | None = None,
                 tls_ca: Pem = None, tls_cert: Pem = None, tls_key: Pem = None,
                 own_connection: bool = False) -> None:
        super().__init__(token)
        options = channel_options(load_balancing, own_connection=own_connection)
        credentials = credentials or tls_credentials(tls_ca, tls_cert, tls_key)
        self._channel = (grpc.secure_channel(target, credentials, options=options)
                         if credentials else grpc.insecure_channel(target, options=options))
        self._stub = pb_grpc.RerankerStub(self._channel)

    def __enter__(self) -> RerankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def rerank(self, query: str, candidates: Iterable[CandidateLike] = (), *,
               timeout: float | None = None, metadata: Metadata | None = None,
               **options: Any) -> RerankAnswer:
        """As `AsyncRerankClient.rerank`."""
        request = build_request(query, candidates, **options)
        try:
            response = self._stub.Rerank(request, timeout=timeout, metadata=self.metadata(metadata))
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return RerankAnswer.from_pb(response)

    def stream(self, query: str, candidates: Iterable[CandidateLike] = (), *,
               timeout: float | None = None, metadata: Metadata | None = None,
               **options: Any) -> Iterator[Result | Summary]:
        """As `AsyncRerankClient.stream`."""
        request = build_request(query, candidates, **options)
        call = self._stub.RerankStream(request, timeout=timeout, metadata=self.metadata(metadata))
        try:
            for message in call:
                yield stream_item(message)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        finally:
            call.cancel()
