"""The server interceptor every RPC passes: log context, the server span, authentication,
per-token limits, load shedding, stalled streams and RPC metrics (docs/architecture.md,
"The gRPC edge"; docs/security.md, "Per-token limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import (  # type: ignore[import-untyped]  # stubs without py.typed
    error_details_pb2,
    status_pb2,
)
from opentelemetry import trace

from ..observability.metrics import (
    LIMIT,
    RPC_METHOD,
    RPC_STATUS,
    RPC_SYSTEM_NAME,
    TOKEN,
    Metrics,
)
from ..observability.server_spans import Opened, close_server_span, open_server_span
from ..security import limits, timeouts
from ..security.limits import ANONYMOUS, Caller, Refusal
from ..security.tokens import TokenSet

log = structlog.get_logger("rerank_server.rpc")

# Methods open without a token: health, for load balancers and kubelet probes.
OPEN_PREFIX = "/grpc.health.v1.Health/"
UNTRACED_PREFIX = "/grpc."  # health and reflection: probes every few seconds
# A refused request of a RerankBatch stream is answered in the stream, which goes on: its
# retry information cannot be the call's.
IN_STREAM_REFUSALS = "/RerankBatch"
# The standard rich status (google.rpc.Status with a RetryInfo), as grpcio-status's
# `rpc_status.to_status` sends it, and a plain entry for clients that do not parse it.
DETAILS_KEY = "grpc-status-details-bin"
RETRY_AFTER_KEY = "retry-after-ms"
# Status codes that mark a server span as failed (OpenTelemetry's gRPC conventions: the
# server's fault, not the caller's).
SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

Behavior = Callable[..., Any]
# A stream message its client has not taken within `timeouts.SEND_STALL_S` plus its size
# at this many bytes a second ends the call.
SEND_RATE_FLOOR = 64 * 1024


class _SendWatch:
    """Cancels a stream's task when one of its messages has waited to be taken longer
    than `timeouts.SEND_STALL_S` plus its size at `SEND_RATE_FLOOR` (a send completes only once
    the client has taken all of it beyond the windows and buffers: a 16 MiB answer to a
    client reading steadily at 150 KB/s takes two minutes). One timer for the whole
    stream, re-armed only when it fires: a message costs its size and two clock reads."""

    def __init__(self, method: str) -> None:
        self._task = asyncio.current_task()
        self._method = method
        self._since: float | None = None  # when the message now going out was handed over
        self._allowed = timeouts.SEND_STALL_S
        self._timer = asyncio.get_running_loop().call_later(timeouts.SEND_STALL_S, self._check)

    def sending(self, size: int) -> None:
        self._since = time.monotonic()
        self._allowed = timeouts.SEND_STALL_S + size / SEND_RATE_FLOOR

    def sent(self) -> None:
        self._since = None

    def _check(self) -> None:
        since = self._since
        waited = 0.0 if since is None else time.monotonic() - since
        allowed = self._allowed if since is not None else timeouts.SEND_STALL_S
        if waited >= allowed and self._task is not None:
            log.warning("rpc_send_stalled", rpc=self._method, waited_s=round(waited, 1))
            self._task.cancel()
            return
        self._timer = asyncio.get_running_loop().call_later(allowed - waited, self._check)

    def close(self) -> None:
        self._timer.cancel()


class RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Binds log context, holds each token to its limits, sheds load above `max_active`
    Reranker RPCs (a low-priority token's sooner: `TokenSet.places`), records each call."""

    def __init__(
        self,
        metrics: Metrics,
        limited_service: str,
        max_active: int,
        tokens: TokenSet | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._metrics = metrics
        self._tracer = tracer  # None: tracing off, no server spans
        self._limited_prefix = f"/{limited_service}/"
        self._tokens = tokens or TokenSet()
        self.places = self._tokens.places(max_active)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(method=details.method)
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.lstrip("/")
        limited = details.method.startswith(self._limited_prefix)
        caller = (
            ANONYMOUS
            if details.method.startswith(OPEN_PREFIX)
            else self._tokens.identify(_metadata(details, "authorization"))
        )
        span = self._span_starter(details)
        if handler.response_streaming:
            wrapped = self._streaming(handler_behavior(handler), method, limited, caller, span)
        else:
            wrapped = self._unary(handler_behavior(handler), method, limited, caller, span)
        return replace_behavior(handler, wrapped)

    def _span_starter(
        self,
        details: grpc.HandlerCallDetails,
    ) -> Callable[[], Opened] | None:
        """What opens this call's server span when it runs; None when it is not traced."""
        if self._tracer is None or details.method.startswith(UNTRACED_PREFIX):
            return None
        tracer = self._tracer
        service, _, name = details.method.lstrip("/").rpartition("/")
        carrier = {
            key: value for key, value in details.invocation_metadata or () if isinstance(value, str)
        }

        def start() -> Opened:
            return open_server_span(
                tracer,
                details.method,
                carrier,
                {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
            )

        return start

    def _admit(self, method: str, limited: bool, caller: Caller) -> bool:
        if not limited:
            return True
        if not self.places.take(caller.limits.priority):
            self._metrics.rpc_rejected.add(1, {RPC_METHOD: method})
            return False
        self._metrics.rpc_active.add(1, {RPC_METHOD: method})
        return True

    def _release(self, method: str, limited: bool) -> None:
        if limited:
            self.places.leave()
            self._metrics.rpc_active.add(-1, {RPC_METHOD: method})

    def _over_limit(self, refusal: Refusal) -> None:
        """A token over one of its limits: counted, and its `rpc` line says which."""
        self._metrics.limit_refusals.add(1, {TOKEN: refusal.caller, LIMIT: refusal.limit})
        structlog.contextvars.bind_contextvars(limit=refusal.limit)

    def _over_limit_later(
        self,
        method: str,
        context: grpc.aio.ServicerContext[Any, Any],
        refusal: Refusal,
    ) -> None:
        """A refusal the handler found (pairs, once the message is read), before the
        handler ends the call with it: its retry information goes in the trailers."""
        self._over_limit(refusal)
        if not method.endswith(IN_STREAM_REFUSALS):
            context.set_trailing_metadata(_retry_trailers(refusal))

    def _record(self, method: str, started: float, code: grpc.StatusCode) -> None:
        self._metrics.rpc_duration.record(
            time.perf_counter() - started,
            {RPC_SYSTEM_NAME: "grpc", RPC_METHOD: method, RPC_STATUS: code.name},
        )

    @contextlib.asynccontextmanager
    async def _admitted(
        self,
        method: str,
        limited: bool,
        caller: Caller | None,
        context: grpc.aio.ServicerContext[Any, Any],
        span: Callable[[], Opened] | None,
    ) -> AsyncIterator[None]:
        """Admit the call (or abort it with UNAUTHENTICATED, or RESOURCE_EXHAUSTED for its
        token's limits or the server's cap), then record how it ended; when traced,
        inside its server span, current throughout, which records the status code. The
        token's concurrency place is given back however the call ends.

        One context manager for both: each layer of generator-based context manager cost
        a few microseconds of a request that takes a few hundred on a batching backend."""
        started = time.perf_counter()
        opened = span() if span is not None else None
        code = grpc.StatusCode.OK
        admitted = False
        admission: limits.Admission | None = None
        try:
            if caller is None:
                code = grpc.StatusCode.UNAUTHENTICATED
                log.info(
                    "rpc",
                    rpc=method,
                    status="UNAUTHENTICATED",
                    error="missing or invalid bearer token",
                )  # never the token itself
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or invalid bearer token: send "
                    "'authorization: Bearer <token>' metadata",
                )
            assert caller is not None  # abort raised
            if caller.name:
                structlog.contextvars.bind_contextvars(token=caller.name)  # never the token
            if limited and caller.limits.counted:
                outcome = await self._tokens.limiter.admit(caller)
                if isinstance(outcome, Refusal):
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    self._over_limit(outcome)
                    log.info("rpc", rpc=method, status=code.name, error=outcome.message)
                    await context.abort(code, outcome.message, _retry_trailers(outcome))
                else:
                    admission = outcome
                    admission.on_refusal = functools.partial(
                        self._over_limit_later, method, context
                    )
                    limits.current.set(admission)  # the handler charges its pairs
            if not self._admit(method, limited, caller):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                busy = self.places.busy(caller.limits.priority, "calls")
                log.info("rpc", rpc=method, status="RESOURCE_EXHAUSTED", error=busy)
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{busy} (max_concurrent_rpcs); retry with backoff",
                )
            admitted = True
            yield
            set_code = context.code()  # set without raising
            if isinstance(set_code, grpc.StatusCode):
                code = set_code
        except BaseException as exc:
            if admitted:
                code = _code_of(exc, context)
            raise
        finally:
            try:
                if admission is not None:
                    admission.release()
                if admitted:
                    self._release(method, limited)
                self._record(method, started, code)
            finally:
                if opened is not None:
                    close_server_span(
                        opened,
                        {"rpc.grpc.status_code": code.value[0]},
                        code.name if code in SERVER_FAULTS else None,
                    )

    def _unary(
        self,
        behavior: Behavior,
        method: str,
        limited: bool,
        caller: Caller | None,
        span: Callable[[], Opened] | None,
    ) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                async with self._admitted(method, limited, caller, context, span):
                    return await behavior(request, context)
            except BaseException:
                # The failure's traceback keeps this frame (through gRPC's abort, in a
                # cycle): not the request bytes with it (`service.Rerank`).
                del request
                raise

        return call

    def _streaming(
        self,
        behavior: Behavior,
        method: str,
        limited: bool,
        caller: Caller | None,
        span: Callable[[], Opened] | None,
    ) -> Behavior:
        if not inspect.isasyncgenfunction(behavior):
            # A handler that sends with `context.write` and returns (grpc_health's
            # Watch): grpc awaits it rather than iterating it, and so must the wrapper.
            async def written(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async with self._admitted(method, limited, caller, context, span):
                    return await behavior(request, context)

            return written

        async def call(
            request: Any,
            context: grpc.aio.ServicerContext[Any, Any],
        ) -> AsyncIterator[Any]:
            try:
                async with self._admitted(method, limited, caller, context, span):
                    if not limited:  # health's Watch: quiet for long spells by design
                        async for response in behavior(request, context):
                            yield response
                        return
                    watch = _SendWatch(method)
                    try:
                        async for response in behavior(request, context):
                            watch.sending(response.ByteSize())
                            yield response  # resumed once grpc has sent it
                            watch.sent()
                    finally:
                        watch.close()
            except BaseException:
                del request  # as in `_unary`
                raise

        return call


def _retry_trailers(refusal: Refusal) -> tuple[tuple[str, str | bytes], ...]:
    """RESOURCE_EXHAUSTED's retry information: `google.rpc.RetryInfo` in the rich status
    (its message the call's, as grpcio-status's `from_call` checks), and in plain ms."""
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=refusal.retry_after_s)
        )
    )
    status = status_pb2.Status(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=refusal.message, details=[info]
    )
    return (
        (DETAILS_KEY, status.SerializeToString()),
        (RETRY_AFTER_KEY, str(refusal.retry_after_s * 1000)),
    )


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for name, value in details.invocation_metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _code_of(
    exc: BaseException,
    context: grpc.aio.ServicerContext[Any, Any],
) -> grpc.StatusCode:
    """The status an RPC ended with when its handler raised `exc`."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        return code  # set by context.abort
    return grpc.StatusCode.UNKNOWN


def handler_behavior(handler: grpc.RpcMethodHandler) -> Behavior:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior: Behavior = getattr(handler, kind)
    return behavior


def replace_behavior(
    handler: grpc.RpcMethodHandler,
    behavior: Behavior,
) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced, same streaming kind and serializers."""
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}
