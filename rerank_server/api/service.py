"""The gRPC servicer: `rerank.v1.Reranker` over the pipeline, reading and parsing its own
request messages within the byte budget (docs/architecture.md, "The gRPC edge").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from ..domain import RankedCandidate, RerankQuery, RerankSummary
from ..errors import InvalidRequest
from ..observability.logs import rpc_cancelled, rpc_failed
from ..observability.telemetry import Telemetry
from ..ranking.pipeline import Reranker
from ..ranking.request import RequestRules
from ..ranking.served_models import ServedModels, UnknownModel
from ..ranking.validation import check_candidate_count, check_list_count
from ..scoring.budget import StopSignal
from ..security import limits, timeouts
from ..security.inflight_bytes import InflightBytes, Overloaded
from . import convert
from .pb import rerank_pb2 as pb

log = structlog.get_logger(__name__)


class _Seen:
    """What is known of a call's request for its log line, even if it fails early."""

    request_id = ""


class _Progress:
    """How far a RerankStream got, for its log line."""

    def __init__(self) -> None:
        self.sent = 0
        self.first_ms: float | None = None
        self.answered = False


# A RerankBatch stream whose client sends nothing for this long gives back the room held
# for its next request: a stream kept open for later requests holds none meanwhile.
BATCH_QUIET_S = 0.25


class AnswerTooLarge(Exception):
    """An answer over the largest message gRPC will send (`--max-message-bytes`)."""


class ReceiveStalled(Exception):
    """The request message did not arrive within `timeouts.BODY_TIMEOUT_S`."""


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, UnknownModel):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, Overloaded | AnswerTooLarge | ReceiveStalled):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"


def _ended(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The status of a call whose handler was cancelled: by its deadline, or else by the
    client (or the server's stop)."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else float(remaining)


def parse_request(raw: bytes, field: str = "request") -> pb.RerankRequest:
    """A RerankRequest from its wire bytes; InvalidRequest when they do not decode."""
    try:
        return pb.RerankRequest.FromString(raw)
    except DecodeError:
        raise InvalidRequest(
            field,
            "cannot be decoded as rerank.v1.RerankRequest "
            "(truncated message, wrong type, or invalid UTF-8 "
            "in a string field)",
        ) from None


class RerankService:
    """The three RPCs, registered as request-streaming: each reads its requests' raw
    bytes itself, through its context (`_read`), and leaves the request iterator gRPC
    passes it unused (see the module docstring)."""

    def __init__(
        self,
        models: ServedModels,
        telemetry: Telemetry,
        rules: RequestRules,
        batch_concurrency: int,
        inflight: InflightBytes,
        max_message_bytes: int | None = None,
    ) -> None:
        self._models = models
        self._telemetry = telemetry
        self._rules = rules
        self._batch_concurrency = batch_concurrency
        self.inflight = inflight
        self._max_message_bytes = max_message_bytes
        self._draining = StopSignal()

    def drain(self) -> None:
        """Shutdown begins: `RerankBatch` streams stop reading requests, answer those they
        have, and end (UNAVAILABLE, naming the first request not read)."""
        self._draining.set()

    def _answer(
        self, rpc: str, results: list[RankedCandidate], summary: RerankSummary, measured: bool
    ) -> pb.RerankResponse:
        """The response, logged and counted; AnswerTooLarge if gRPC could not send it.
        Only answers that can grow past the request are measured (measuring costs about
        a serialization): those with texts, and those whose lists' names may add up
        (`_lists_may_overflow`: each result names every list it was found in, so long
        list names multiply by the results).
        Without, a response's size is bounded far below the limit by the request's own
        caps."""
        response = convert.response_to_pb(results, summary)
        if measured and self._max_message_bytes is not None:
            size = response.ByteSize()
            if size > self._max_message_bytes:
                # Refused here, naming the way out, rather than logged OK and then
                # failed by gRPC with a message about its own limit.
                raise AnswerTooLarge(
                    f"the answer is {size} bytes, over this server's --max-message-bytes "
                    f"({self._max_message_bytes}): ask for fewer results (top_k), "
                    "without return_text, or with shorter list names"
                )
        self._finish(rpc, summary, len(results))
        return response

    def _lists_may_overflow(
        self,
        query: RerankQuery,
        results: list[RankedCandidate],
    ) -> bool:
        """Whether the lists' names (`found_in`, in each result that was found in them)
        may bring the answer near the limit: a bound, in bytes, against a quarter of
        it, so that the common hybrid request is not measured (measuring the answer is
        work on every request)."""
        if not query.lists or self._max_message_bytes is None:
            return False
        names = sum(4 * len(lst.name) + 3 for lst in query.lists)
        return len(results) * names > self._max_message_bytes // 4

    def _finish(self, rpc: str, summary: RerankSummary, returned: int, **extra: Any) -> None:
        self._telemetry.answered(rpc, summary, returned, **extra)

    def _room(self) -> int:
        """The room held for a message before it is read: the largest gRPC accepts (the
        whole budget at most, which a message alone may still pass)."""
        largest = self._max_message_bytes or self.inflight.limit
        return min(largest, self.inflight.limit)

    async def _receive(self, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """The call's one request message, read once room for the largest message is held
        (Overloaded before it is read when the requests in progress leave none), and
        counted in flight at its real size: the caller gives it back (`_admitted`)."""
        room = self._room()
        try:
            async with asyncio.timeout(timeouts.BODY_TIMEOUT_S):
                await self.inflight.hold(room)
        except TimeoutError:
            raise Overloaded(
                f"server busy: no room in max_inflight_bytes for the request within "
                f"{timeouts.BODY_TIMEOUT_S:.0f} s; retry with backoff"
            ) from None
        try:
            async with asyncio.timeout(timeouts.BODY_TIMEOUT_S):
                raw = await _read(context)
        except TimeoutError:
            self.inflight.release(room)
            raise ReceiveStalled(
                f"the request message did not arrive within {timeouts.BODY_TIMEOUT_S:.0f} s"
            ) from None
        except StopAsyncIteration:
            self.inflight.release(room)
            raise InvalidRequest("request", "missing: the call carried no message") from None
        except BaseException:
            self.inflight.release(room)
            raise
        self.inflight.settle(room, len(raw))
        return raw

    @contextlib.asynccontextmanager
    async def _admitted(
        self,
        raw: bytes,
        seen: _Seen,
        field: str = "request",
    ) -> AsyncIterator[tuple[RerankQuery, Reranker]]:
        """The request as a domain query, and the pipeline of the model it names; its
        bytes, counted in flight by the caller, are given back when it is done."""
        size = len(raw)
        try:
            request = parse_request(raw, field)
            del raw
            seen.request_id = self._rules.echoable_id(request.request_id)
            _check_counts(request, self._rules)
            reranker = self._models.select(request.model).reranker
            # The token's pairs per minute: candidates as received, capped at what is scored.
            sent = len(request.candidates) + sum(len(lst.candidates) for lst in request.lists)
            await limits.charge_pairs(min(sent, self._rules.max_candidates))
            yield convert.query_from_pb(request), reranker
        finally:
            self.inflight.give_back(size)

    # A call that fails holds nothing of its request when it is reported: the work runs
    # in a helper whose frame has ended by then (`_abort` clears the ended frames), and the
    # handler lets go of its bytes. A failed call's exception sits in a reference cycle
    # through gRPC's abort, and with the collector tuned down (`freeze_startup_objects`)
    # a flood of refused large requests would otherwise keep each one alive for seconds.

    async def Rerank(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RerankResponse:
        started, seen = time.perf_counter(), _Seen()
        try:
            return await self._rerank(await self._receive(context), seen, context)
        except asyncio.CancelledError:
            rpc_cancelled("Rerank", seen.request_id, started, _ended(context))
            raise
        except Exception as exc:
            await self._abort(context, "Rerank", seen.request_id, started, exc)
            raise  # unreachable: abort raises

    async def _rerank(
        self, raw: bytes, seen: _Seen, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RerankResponse:
        async with self._admitted(raw, seen) as (query, reranker):
            del raw  # the domain query holds what is needed
            # One span for the call and its request (`Telemetry.request_span`). Not for
            # RerankStream: a stream cancelled while gRPC waits to send ends its server
            # span before the pipeline is closed, and the scoring's counts would be lost.
            results, summary = await reranker.answer(
                query, _deadline(context), self._telemetry.request_span()
            )
            measured = query.return_text or self._lists_may_overflow(query, results)
        return self._answer("Rerank", results, summary, measured)

    async def RerankStream(
        self,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.RerankStreamMessage]:
        started, seen = time.perf_counter(), _Seen()
        progress = _Progress()
        try:
            messages = self._stream(await self._receive(context), seen, context, started, progress)
            async with contextlib.aclosing(messages):
                async for message in messages:
                    yield message
        except (asyncio.CancelledError, GeneratorExit):
            if not progress.answered:  # cancelled while results were still going out
                rpc_cancelled("RerankStream", seen.request_id, started, _ended(context))
            raise
        except Exception as exc:
            await self._abort(context, "RerankStream", seen.request_id, started, exc)

    async def _stream(
        self,
        raw: bytes,
        seen: _Seen,
        context: grpc.aio.ServicerContext[Any, Any],
        started: float,
        progress: _Progress,
    ) -> AsyncGenerator[pb.RerankStreamMessage, None]:
        async with (
            self._admitted(raw, seen) as (query, reranker),
            contextlib.aclosing(reranker.run(query, _deadline(context))) as items,
        ):
            del raw
            # To the pipeline's end (the summary is its last item), and closed at once
            # when the client goes away: a generator left suspended is closed only when
            # the event loop gets to its finalizer.
            async for item in items:
                if isinstance(item, RerankSummary):
                    self._finish(
                        "RerankStream", item, progress.sent, first_result_ms=progress.first_ms
                    )
                    progress.answered = True
                    yield pb.RerankStreamMessage(summary=convert.summary_to_pb(item))
                    continue
                if progress.first_ms is None:
                    progress.first_ms = (time.perf_counter() - started) * 1000
                progress.sent += 1
                yield pb.RerankStreamMessage(result=convert.result_to_pb(item))

    async def RerankBatch(
        self,
        requests: AsyncIterable[bytes],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.RerankResponse]:
        """Runs up to `batch_concurrency` requests at once; answers as each completes
        (`_BatchStream`). The requests are read through `context`, not `requests`."""
        stream = _BatchStream(self, context, self._batch_concurrency)
        async with contextlib.aclosing(stream.answers()) as answers:
            async for answer in answers:
                yield answer

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        rpc: str,
        request_id: str,
        started: float,
        exc: Exception,
    ) -> None:
        traceback.clear_frames(exc.__traceback__)
        code, message = _status_for(exc)
        rpc_failed(
            rpc, request_id, started, code.name, exc, internal=code is grpc.StatusCode.INTERNAL
        )
        await context.abort(code, message)


class _BatchStream:
    """One `RerankBatch` call: its requests read in turn, run up to `concurrency` at once,
    and answered as each completes.

    Back-pressure: a request's slot is given back only once its answer is queued, and the
    queue holds at most `concurrency` answers, so a client that stops reading answers
    stops the server reading requests (and gRPC's flow control stops the client writing
    them)."""

    def __init__(
        self,
        service: RerankService,
        context: grpc.aio.ServicerContext[Any, Any],
        concurrency: int,
    ) -> None:
        self._service = service
        self._context = context
        self._done: asyncio.Queue[pb.RerankResponse] = asyncio.Queue(concurrency)
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading = True
        self._cut = False  # reading stopped by the server's shutdown
        self._position = 0  # requests read
        self._begun: set[int] = set()  # positions whose task has run (`_unbegun`)
        self._feeder: asyncio.Task[None] | None = None

    async def answers(self) -> AsyncGenerator[pb.RerankResponse, None]:
        """Every request's answer, as each completes; UNAVAILABLE once the server drains
        (the requests read before are answered first)."""
        feeder = self._feeder = asyncio.create_task(self._feed())
        draining = self._service._draining
        stop_listening = draining.subscribe(self._stop_reading)
        if draining.is_set():
            self._stop_reading()
        done = self._done
        try:
            # Until the feeder is done and every answer is out. No sentinel in the queue:
            # a feeder cancelled while the queue is full must not wait to put one.
            while not (feeder.done() and done.empty()):
                getter = asyncio.ensure_future(done.get())
                await asyncio.wait({getter, feeder}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            # Surfaces a broken request stream. A feeder cut before its first step (the
            # drain began as the call did) never ran its body to take the cut in.
            if not (self._cut and feeder.cancelled()):
                await feeder
            if self._cut:
                await self._drained()
        finally:
            stop_listening()
            for task in (feeder, *self._tasks):
                task.cancel()

    async def _drained(self) -> None:
        log.info("batch_stream_drained", read=self._position)
        await self._context.abort(
            grpc.StatusCode.UNAVAILABLE,
            (
                f"the server is shutting down: requests[{self._position}] and any after it "
                "were not read (every request before it was answered); send them "
                "again, to another server"
            ),
        )

    def _stop_reading(self) -> None:
        # A stream the client keeps open would otherwise take requests until the grace
        # period ran out, and then be cancelled with them.
        if self._reading and not self._cut and self._feeder is not None:
            self._cut = True
            self._feeder.cancel()

    async def _feed(self) -> None:
        try:
            while (read := await self._next()) is not None:
                raw, counted = read
                position = self._position
                task = asyncio.create_task(self._one(raw, position, counted))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(
                    functools.partial(self._unbegun, position, len(raw) if counted else 0)
                )
                self._position += 1
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self._cut or current is None or current.cancelling() != 1:
                raise  # the call's own end, not (only) the drain
            current.uncancel()
        self._reading = False
        if self._tasks:
            await asyncio.gather(*self._tasks)

    async def _next(self) -> tuple[bytes, bool] | None:
        """The next request and whether it is counted in flight already; None at the
        stream's end. Read once the stream has a free slot (taken here; the request's
        task gives it back) and room for the largest message is held, waiting for room
        rather than refused: a batch's requests wait their turn. The room goes back while
        the client sends nothing for `BATCH_QUIET_S` (a stream kept open holds none);
        what it sends after that is counted once it is in."""
        inflight = self._service.inflight
        await self._slots.acquire()
        room = self._service._room()
        try:
            await inflight.hold(room, patient=True)
        except BaseException:
            self._slots.release()
            raise
        read = asyncio.ensure_future(_read(self._context))
        raw: bytes | None = None
        try:
            done, _ = await asyncio.wait({read}, timeout=BATCH_QUIET_S)
            if not done:
                inflight.release(room)
                room = 0
            raw = await read
        except StopAsyncIteration:
            pass  # the stream's end
        finally:
            if raw is None:
                read.cancel()
                inflight.release(room)
                self._slots.release()
        if raw is None:
            return None
        if room:
            inflight.settle(room, len(raw))
        return raw, room > 0

    async def _one(self, raw: bytes, position: int, counted: bool) -> None:
        """One request run, its answer (or its error) queued, its slot given back."""
        self._begun.add(position)
        started, seen = time.perf_counter(), _Seen()
        try:
            try:
                answer = await self._answer(raw, position, counted, seen)
            except asyncio.CancelledError:
                rpc_cancelled("RerankBatch", seen.request_id, started, _ended(self._context))
                raise
            except Exception as exc:
                traceback.clear_frames(exc.__traceback__)  # see `Rerank`
                answer = _batch_error(exc, position, seen, started)
            await self._done.put(answer)
        finally:
            self._slots.release()

    async def _answer(
        self, raw: bytes, position: int, counted: bool, seen: _Seen
    ) -> pb.RerankResponse:
        service = self._service
        if not counted:  # read without room held (`_next`): counted now
            service.inflight.take(len(raw))
        async with service._admitted(raw, seen, f"requests[{position}]") as (query, reranker):
            results, summary = await reranker.answer(query, _deadline(self._context))
            measured = query.return_text or service._lists_may_overflow(query, results)
        return service._answer("RerankBatch", results, summary, measured)

    def _unbegun(self, position: int, counted: int, _: asyncio.Task[None]) -> None:
        # A task cancelled before its first step (the stream ending) never ran: the bytes
        # counted for its request are given back here instead of by `_admitted`.
        if position not in self._begun and counted:
            self._service.inflight.give_back(counted)
        self._begun.discard(position)


def _batch_error(exc: Exception, position: int, seen: _Seen, started: float) -> pb.RerankResponse:
    """A batch request's refusal, as its answer in the stream, with its `rpc` log line."""
    code, message = _status_for(exc)
    if (
        isinstance(exc, InvalidRequest)
        and not seen.request_id
        and not message.startswith("requests[")
    ):
        # No id to match the answer by: its position in the stream says which request it
        # was, as for one that did not decode.
        message = f"requests[{position}].{message}"
    rpc_failed(
        "RerankBatch",
        seen.request_id,
        started,
        code.name,
        exc,
        internal=code is grpc.StatusCode.INTERNAL,
    )
    return pb.RerankResponse(
        request_id=seen.request_id,
        error=pb.RequestError(code=code.value[0], message=message),
    )


async def _read(context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """The call's next request message; StopAsyncIteration at the end of its requests.
    Through `context.read()`, which keeps nothing of it: the request iterator grpc hands
    the handler holds the last message it yielded until the next is asked for, and a
    failed call's frames keep the iterator (in a cycle, until a full collection)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        raise StopAsyncIteration
    assert isinstance(raw, bytes)  # no deserializer is registered (`grpc_server`)
    return raw


def _check_counts(request: pb.RerankRequest, rules: RequestRules) -> None:
    """The caps on counts, read off the parsed message before anything is built from it
    (validation checks them again, with the rest): protobuf parses a message of
    millions of empty candidates far faster than they can be converted, and converting
    them would hold the event loop, health checks waiting behind."""
    check_candidate_count("candidates", len(request.candidates), rules)
    check_list_count(len(request.lists), rules)
    for i, lst in enumerate(request.lists):
        check_candidate_count(f"lists[{i}].candidates", len(lst.candidates), rules)
