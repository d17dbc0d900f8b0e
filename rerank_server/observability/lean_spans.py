"""The server's spans, recorded without the SDK's per-span generality.

What is kept and what is left out: docs/observability.md, "Lean spans".
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator, Mapping, Sequence
from time import time_ns
from types import MappingProxyType, TracebackType

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
)
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util import types
from opentelemetry.util._decorator import _agnosticcontextmanager

_EXACT = frozenset((str, bool, int, float))  # the values we set: stored as they are
# The SDK's default sampler, as it describes itself: follow the parent's decision, sample
# every root. `LeanTracer` decides as it would without building its result objects.
_DEFAULT_SAMPLER = (
    "ParentBased{root:AlwaysOnSampler,remoteParentSampled:AlwaysOnSampler,"
    "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:"
    "AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
)
_RANDOM_TRACE_ID = getattr(trace.TraceFlags, "RANDOM_TRACE_ID", 0)


def _attributes(
    into: dict[str, types.AttributeValue], attributes: types.Attributes
) -> dict[str, types.AttributeValue]:
    """`attributes` added to `into`: ours (str keys, scalar values) as they are, anything
    else as the installed SDK would store it (its rules have changed between releases)."""
    if attributes:
        odd: dict[str, types.AttributeValue] = {}
        for key, value in attributes.items():
            if type(value) in _EXACT and type(key) is str and key:
                into[key] = value
            else:
                odd[key] = value
        if odd:
            into.update(BoundedAttributes(attributes=odd, immutable=False).items())
    return into


def _is_valid_link(context: trace.SpanContext, attributes: types.Attributes) -> bool:
    """The SDK's rule: a link needs a valid context, or attributes or a trace state."""
    return bool(context and (context.is_valid or attributes or context.trace_state))


def _link(context: trace.SpanContext, attributes: types.Attributes) -> trace.Link:
    return trace.Link(context, _attributes({}, attributes))


class LeanSpan(trace.Span):
    """A recording span of this server's: sampled, identified and ended as the SDK's
    (the same `ReadableSpan` to the same processors), without checking and copying each
    plain attribute, a lock per span (it lives on one event loop), or the SDK's own span
    metrics (recorded only with a meter provider this server never gives it)."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end",
        "_events",
        "_kind",
        "_links",
        "_name",
        "_on_exception",
        "_parent",
        "_start",
        "_status",
        "_tracer",
    )

    def __init__(
        self,
        tracer: LeanTracer,
        name: str,
        context: trace.SpanContext,
        parent: trace.SpanContext | None,
        kind: trace.SpanKind,
        attributes: dict[str, types.AttributeValue],
        links: Sequence[trace.Link],
        start: int,
        on_exception: tuple[bool, bool] = (True, True),
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._events: list[Event] = []
        self._links = [
            _link(link.context, link.attributes)
            for link in links
            if _is_valid_link(link.context, link.attributes)
        ]
        self._status = trace.Status(trace.StatusCode.UNSET)
        self._start = start
        self._end: int | None = None
        self._on_exception = on_exception  # (record it, set status ERROR), as `start_span`

    # What the SDK's span lets a processor's `on_start` read.
    name = property(lambda self: self._name)
    context = property(lambda self: self._context)
    parent = property(lambda self: self._parent)
    kind = property(lambda self: self._kind)
    start_time = property(lambda self: self._start)
    end_time = property(lambda self: self._end)
    status = property(lambda self: self._status)
    attributes = property(lambda self: MappingProxyType(self._attributes))
    events = property(lambda self: tuple(self._events))
    links = property(lambda self: tuple(self._links))
    resource = property(lambda self: self._tracer.resource)
    instrumentation_scope = property(lambda self: self._tracer.scope)

    def get_span_context(self) -> trace.SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        if self._end is None:
            _attributes(self._attributes, attributes)

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self._end is None:
            _attributes(self._attributes, {key: value})

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        if self._end is None:
            self._events.append(
                Event(
                    name,
                    _attributes({}, attributes),
                    timestamp if timestamp is not None else time_ns(),
                )
            )

    def add_link(self, context: trace.SpanContext, attributes: types.Attributes = None) -> None:
        if self._end is None and _is_valid_link(context, attributes):
            self._links.append(_link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_status(
        self, status: trace.Status | trace.StatusCode, description: str | None = None
    ) -> None:
        # As the SDK: OK is final, and UNSET never overwrites.
        if self._end is not None or self._status.status_code is trace.StatusCode.OK:
            return
        if isinstance(status, trace.StatusCode):
            status = trace.Status(status, description)
        if status.status_code is not trace.StatusCode.UNSET:
            self._status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module, name = type(exception).__module__, type(exception).__qualname__
        event: dict[str, types.AttributeValue] = {
            "exception.type": f"{module}.{name}" if module and module != "builtins" else name,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        self.add_event("exception", _attributes(event, attributes), timestamp)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """`with tracer.start_span(...)`: an escaping exception recorded, as the SDK's."""
        if error is not None and self._end is None:
            record, set_status = self._on_exception
            if record:
                self.record_exception(error, escaped=True)
            if set_status:
                self.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")
        self.end()

    def end(self, end_time: int | None = None) -> None:
        if self._end is not None:
            return
        self._end = end_time if end_time is not None else time_ns()
        tracer = self._tracer
        tracer.processor.on_end(
            ReadableSpan(
                name=self._name,
                context=self._context,
                parent=self._parent,
                resource=tracer.resource,
                attributes=self._attributes,
                events=tuple(self._events),
                links=tuple(self._links),
                kind=self._kind,
                status=self._status,
                start_time=self._start,
                end_time=self._end,
                instrumentation_scope=tracer.scope,
            )
        )


class LeanTracer(trace.Tracer):
    """Starts `LeanSpan`s as the SDK's tracer would start its spans: same sampling, same
    ids, same processors."""

    def __init__(
        self, provider: TracerProvider, processor: SpanProcessor, scope: InstrumentationScope
    ) -> None:
        self.processor = processor
        self.resource = provider.resource
        self.scope = scope
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self._random_ids = bool(getattr(self._ids, "is_trace_id_random", lambda: False)())
        self._default_sampler = self._sampler.get_description() == _DEFAULT_SAMPLER

    def start_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        links = links or ()
        parent: trace.SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            random_ids = bool(parent.trace_flags & _RANDOM_TRACE_ID)
        else:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random_ids = self._random_ids
        if self._default_sampler:
            # What the default sampler decides: the parent's flag, or sample a root.
            sampled = parent is None or parent.trace_flags.sampled
            flags = trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT
            trace_state = parent.trace_state if parent is not None else None
            span_attributes = _attributes({}, attributes) if sampled else {}
        else:
            result = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = result.decision is not Decision.DROP
            flags = (
                trace.TraceFlags.SAMPLED
                if result.decision is Decision.RECORD_AND_SAMPLE
                else trace.TraceFlags.DEFAULT
            )
            trace_state = result.trace_state
            span_attributes = _attributes({}, result.attributes)
        if random_ids:
            flags |= _RANDOM_TRACE_ID
        span_context = trace.SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=trace_state,
        )
        if not sampled:
            return trace.NonRecordingSpan(span_context)
        span = LeanSpan(
            self,
            name,
            span_context,
            parent,
            kind,
            span_attributes,
            links,
            start_time if start_time is not None else time_ns(),
            (record_exception, set_status_on_exception),
        )
        self.processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span

    @_agnosticcontextmanager  # the API's own decorator for this method, as the SDK's
    def start_as_current_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(
            name,
            context,
            kind,
            attributes,
            links,
            start_time,
            record_exception,
            set_status_on_exception,
        )
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


def lean_tracer(
    provider: TracerProvider, processor: SpanProcessor, name: str, version: str
) -> trace.Tracer:
    """A tracer for `provider`, whose span processor is `processor` (added here): a
    `LeanTracer` where it records what the SDK's tracer would, the SDK's otherwise.

    Otherwise: span limits other than the defaults (`OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`,
    ...), which a lean span does not apply, or the SDK disabled (`OTEL_SDK_DISABLED`). A
    processor added to the provider later would not see lean spans; nothing adds one. The
    resource is the provider's now (workers are spawned, not forked: none inherits another's).
    """
    provider.add_span_processor(processor)
    sdk = provider.get_tracer(name, version)
    # The limits the provider applies, read from the environment as it read them.
    if isinstance(sdk, trace.NoOpTracer) or _limits(SpanLimits()) != _DEFAULT_LIMITS:
        return sdk
    return LeanTracer(provider, processor, InstrumentationScope(name, version))


def _limits(limits: SpanLimits) -> tuple[int | None, ...]:
    return (
        limits.max_span_attributes,
        limits.max_events,
        limits.max_links,
        limits.max_event_attributes,
        limits.max_link_attributes,
        limits.max_attribute_length,
        limits.max_span_attribute_length,
    )


# The SDK's defaults: 128 of each, no length limit. No span of ours comes near them.
_DEFAULT_LIMITS = (128, 128, 128, 128, 128, None, None)
