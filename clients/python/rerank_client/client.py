"""Async and sync clients for `rerank.v1.Reranker`.

Both take the same arguments and return the same typed values. Failed calls raise the
exceptions in `errors`; a degraded answer (scorer trouble on the server) is not an error:
check `answer.reranked` and `answer.summary.degraded_code`.

For a server behind a headless Kubernetes Service, pass `load_balancing="round_robin"` and
a `dns:///` target so calls spread over every pod instead of sticking to the first one.

Security: `token` is sent as `authorization: Bearer <token>` with every call (servers run
with `--auth-tokens`); `tls_ca` (a PEM file or bytes) turns on TLS and verifies the server
against that CA, and `tls_cert` + `tls_key` add a client certificate for mutual TLS. A
token sent in plaintext to a host other than loopback warns (`InsecureTokenWarning`).

Defaults a production caller wants, all overridable per client:
- `default_timeout` (30 s): the deadline of `rerank` and `stream` calls made without a
  `timeout`. Without one, a call to a server that accepted the connection and then hung
  (a stopped process, a black-holed network) would wait forever.
- `retry_attempts` (3): `Rerank` and `RerankStream` read and change nothing, so gRPC sends
  them again, with jittered back-off (0.1 s doubling to 1 s), when one ends `UNAVAILABLE`
  before any answer came: the connection reset under it, or the server (a pod being
  replaced) refused it. The retry stays within the call's deadline, and on a channel with
  `load_balancing="round_robin"` goes to the next pod. `RerankBatch` is never retried (it
  answers part of its stream, and names what it did not read when it ends). While most
  calls fail, gRPC's retry throttling stops the retries (no retry storm).
  A request larger than gRPC's retry buffer (256 KiB) is sent once.
"""

from __future__ import annotations

import ipaddress
import json
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from . import errors
from .pb import rerank_pb2_grpc as pb_grpc
from .types import CandidateLike, RerankAnswer, Result, Summary, build_request, stream_item

# Call metadata sent with a request, e.g. [("traceparent", "00-...-01")] to continue a trace.
Metadata = Sequence[tuple[str, str]]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_ATTEMPTS = 3
MAX_RETRY_ATTEMPTS = 5  # gRPC's own cap: a policy asking for more is cut to 5
SERVICE = "rerank.v1.Reranker"
# Unary and server-streaming: safe to send again. Not RerankBatch (see the module doc).
RETRIED_METHODS = ("Rerank", "RerankStream")


class InsecureTokenWarning(UserWarning):
    """A bearer token will go out in plaintext to a host that is not loopback."""


def retry_policy(attempts: int) -> dict[str, Any]:
    """The service config's method config that retries the idempotent calls on
    UNAVAILABLE. gRPC waits a random time up to the current back-off before each try."""
    return {
        "name": [{"service": SERVICE, "method": m} for m in RETRIED_METHODS],
        "retryPolicy": {
            "maxAttempts": attempts,
            "initialBackoff": "0.1s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }


def channel_options(
    load_balancing: str | None = None,
    max_message_bytes: int = 16 * 1024 * 1024,
    own_connection: bool = False,
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS,
) -> list[tuple[str, Any]]:
    """`own_connection`: this channel opens its own connections instead of sharing those of
    other channels to the same target in this process (grpc's default). A server's
    workers (`--workers`) and a pod's replicas behind a plain Service spread connections,
    not calls. `retry_attempts`: tries in all of an idempotent call that ends
    `UNAVAILABLE` (1: no retry; at most 5)."""
    if not 1 <= retry_attempts <= MAX_RETRY_ATTEMPTS:
        raise ValueError(f"retry_attempts must be 1..{MAX_RETRY_ATTEMPTS}, not {retry_attempts}")
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    config: dict[str, Any] = {}
    if load_balancing:
        config["loadBalancingConfig"] = [{load_balancing: {}}]
    if retry_attempts > 1:
        config["methodConfig"] = [retry_policy(retry_attempts)]
        # No retry storm: while most calls fail (a server down, every pod draining) the
        # channel stops retrying (a failure takes a token, a success gives back a tenth;
        # retries only above half of 10), and resumes as calls succeed again.
        config["retryThrottling"] = {"maxTokens": 10, "tokenRatio": 0.1}
    if config:
        options.append(("grpc.service_config", json.dumps(config)))
    return options


def is_local(target: str) -> bool:
    """Whether a gRPC target names this host: loopback or a Unix socket. Anything not
    understood counts as remote (the warning errs on the side of showing)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    # ipv4:a,b lists addresses: local only if every one is.
    return all(_is_local_address(address) for address in target.split(","))


def _is_local_address(address: str) -> bool:
    if address.startswith("["):
        host = address[1 : address.find("]")]
    else:
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Pem = str | bytes | None  # a PEM file's path, or its bytes


def _pem(value: Pem) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def tls_credentials(
    tls_ca: Pem = None, tls_cert: Pem = None, tls_key: Pem = None
) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS (None when no CA is given: plaintext)."""
    if tls_ca is None:
        if tls_cert is not None or tls_key is not None:
            raise ValueError(
                "tls_cert/tls_key need tls_ca: without a CA the channel would be plaintext"
            )
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert)
    )


class _Calls:
    """What both clients share: the metadata every call carries, the default deadline."""

    def __init__(
        self, target: str, token: str | None, secure: bool, default_timeout: float | None
    ) -> None:
        if token and not secure and not is_local(target):
            warnings.warn(
                f"the token goes to {target} in plaintext: pass tls_ca (or "
                "credentials) unless the network itself is encrypted",
                InsecureTokenWarning,
                stacklevel=3,
            )
        if default_timeout is not None and not default_timeout > 0:
            raise ValueError(f"default_timeout must be > 0 seconds or None, not {default_timeout}")
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._default_timeout = default_timeout

    def timeout(self, timeout: float | None) -> float | None:
        return self._default_timeout if timeout is None else timeout

    def metadata(self, extra: Metadata | None) -> Metadata | None:
        if not self._auth:
            return extra
        return (*self._auth, *(extra or ()))


class AsyncRerankClient(_Calls):
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        load_balancing: str | None = None,
        token: str | None = None,
        tls_ca: Pem = None,
        tls_cert: Pem = None,
        tls_key: Pem = None,
        own_connection: bool = False,
        default_timeout: float | None = DEFAULT_TIMEOUT_S,
        retry_attempts: int = DEFAULT_RETRY_ATTEMPTS,
    ) -> None:
        options = channel_options(
            load_balancing, own_connection=own_connection, retry_attempts=retry_attempts
        )
        credentials = credentials or tls_credentials(tls_ca, tls_cert, tls_key)
        super().__init__(target, token, credentials is not None, default_timeout)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._stub = pb_grpc.RerankerStub(self._channel)

    async def __aenter__(self) -> AsyncRerankClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def rerank(
        self,
        query: str,
        candidates: Iterable[CandidateLike] = (),
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Any,
    ) -> RerankAnswer:
        """Rerank `candidates` for `query`. `options`: model (a served model's name),
        top_k, instruction, request_id, blend_strategy, max_candidates, max_chunk_chars,
        timeout_ms, return_text, and the rest of `build_request`'s.
        `metadata` goes out with the call (a W3C `traceparent` continues your trace)."""
        request = build_request(query, candidates, **options)
        try:
            response = await self._stub.Rerank(
                request, timeout=self.timeout(timeout), metadata=self.metadata(metadata)
            )
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return RerankAnswer.from_pb(response)

    async def stream(
        self,
        query: str,
        candidates: Iterable[CandidateLike] = (),
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Any,
    ) -> AsyncIterator[Result | Summary]:
        """Results in final order as each becomes certain, then the `Summary`."""
        request = build_request(query, candidates, **options)
        call = self._stub.RerankStream(
            request, timeout=self.timeout(timeout), metadata=self.metadata(metadata)
        )
        try:
            async for message in call:
                yield stream_item(message)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def rerank_many(
        self,
        queries: Mapping[str, tuple[str, Sequence[CandidateLike]]],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Any,
    ) -> AsyncIterator[tuple[str, RerankAnswer | errors.RerankError]]:
        """Many queries over one `RerankBatch` stream, keyed by request id.

        Yields `(request_id, answer)` as each completes, in completion order; a request
        the server rejected yields its `RerankError` instead of an answer. `timeout` is the
        whole stream's deadline: none unless given (not `default_timeout`, which is sized
        for one request). Closing the generator cancels the call: leave the loop early
        inside `contextlib.aclosing(client.rerank_many(...))` to have that happen at
        once (otherwise it happens when the generator is collected).
        """
        requests = [
            build_request(q, c, request_id=rid, **options) for rid, (q, c) in queries.items()
        ]
        call = self._stub.RerankBatch(
            iter(requests), timeout=timeout, metadata=self.metadata(metadata)
        )
        try:
            async for response in call:
                if response.HasField("error"):
                    yield response.request_id, errors.from_batch_error(response.error)
                else:
                    yield response.request_id, RerankAnswer.from_pb(response)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        finally:
            call.cancel()


class RerankClient(_Calls):
    """Blocking client over a plain grpc channel; usable from any thread."""

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        load_balancing: str | None = None,
        token: str | None = None,
        tls_ca: Pem = None,
        tls_cert: Pem = None,
        tls_key: Pem = None,
        own_connection: bool = False,
        default_timeout: float | None = DEFAULT_TIMEOUT_S,
        retry_attempts: int = DEFAULT_RETRY_ATTEMPTS,
    ) -> None:
        options = channel_options(
            load_balancing, own_connection=own_connection, retry_attempts=retry_attempts
        )
        credentials = credentials or tls_credentials(tls_ca, tls_cert, tls_key)
        super().__init__(target, token, credentials is not None, default_timeout)
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = pb_grpc.RerankerStub(self._channel)

    def __enter__(self) -> RerankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def rerank(
        self,
        query: str,
        candidates: Iterable[CandidateLike] = (),
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Any,
    ) -> RerankAnswer:
        """As `AsyncRerankClient.rerank`."""
        request = build_request(query, candidates, **options)
        try:
            response = self._stub.Rerank(
                request, timeout=self.timeout(timeout), metadata=self.metadata(metadata)
            )
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return RerankAnswer.from_pb(response)

    def stream(
        self,
        query: str,
        candidates: Iterable[CandidateLike] = (),
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Any,
    ) -> Iterator[Result | Summary]:
        """As `AsyncRerankClient.stream`."""
        request = build_request(query, candidates, **options)
        call = self._stub.RerankStream(
            request, timeout=self.timeout(timeout), metadata=self.metadata(metadata)
        )
        try:
            for message in call:
                yield stream_item(message)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        finally:
            call.cancel()
