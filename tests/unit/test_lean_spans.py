"""A lean span exports what the SDK's span exports for the same calls, decides sampling as
the configured sampler does, and gives way to the SDK where it would not record the same
(`observability/lean_spans.py`)."""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from rerank_server.observability.lean_spans import LeanTracer, lean_tracer

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736


class _Counting(IdGenerator):
    """The same ids for both tracers, so their spans can be compared field by field."""

    def __init__(self) -> None:
        self.next = 0

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        return TRACE_ID


Made = tuple[trace.Tracer, InMemorySpanExporter]


def _tracer(lean: bool = True, **provider: object) -> Made:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(
        resource=Resource.create({"service.name": "t"}), id_generator=_Counting(), **provider
    )  # type: ignore[arg-type]
    processor = SimpleSpanProcessor(exporter)
    if lean:
        return lean_tracer(tracer_provider, processor, "rerank_server", "1.0"), exporter
    tracer_provider.add_span_processor(processor)
    return tracer_provider.get_tracer("rerank_server", "1.0"), exporter


def _remote(sampled: bool) -> otel_context.Context:
    parent = trace.SpanContext(
        TRACE_ID, 0xABC, is_remote=True, trace_flags=trace.TraceFlags(int(sampled))
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _story(tracer: trace.Tracer) -> None:
    """What the server does with a span, and what it never does but the API allows."""
    span = tracer.start_span(
        "/rerank.v1.Reranker/Rerank",
        context=_remote(True),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rerank.pairs": 40},
    )
    span.set_attributes(
        {
            "rerank.scored": 39,
            "rerank.ratio": 0.5,
            "rerank.ok": True,
            "rerank.ids": [1, 2],
            "rerank.none": None,  # type: ignore[dict-item]
            "rerank.mixed": [1, "a"],
        }
    )  # type: ignore[list-item]
    span.add_event("retry", {"attempt": 2}, timestamp=123)
    span.record_exception(ValueError("no score"), timestamp=456)
    span.set_status(trace.StatusCode.ERROR, "backend down")
    span.set_status(trace.StatusCode.UNSET)  # never overwrites
    span.update_name("renamed")
    span.end()
    span.set_attribute("after", "the end")  # ignored, as the SDK ignores it
    span.end()  # once


def _fields(span: ReadableSpan) -> tuple[object, ...]:
    return (
        span.name,
        span.context,
        span.parent,
        span.kind,
        dict(span.attributes or {}),
        [(e.name, dict(e.attributes or {}), e.timestamp) for e in span.events],
        span.status.status_code,
        span.status.description,
        span.resource,
        span.instrumentation_scope,
        span.dropped_attributes,
    )


def test_a_lean_span_exports_what_the_sdk_span_exports() -> None:
    lean, lean_spans = _tracer()
    sdk, sdk_spans = _tracer(lean=False)
    assert isinstance(lean, LeanTracer) and isinstance(sdk, SdkTracer)
    _story(lean)
    _story(sdk)
    (ours,), (theirs,) = lean_spans.get_finished_spans(), sdk_spans.get_finished_spans()
    assert _fields(ours) == _fields(theirs)
    # The plain values as they were set (the others as the installed SDK stores them,
    # which has changed between its releases: compared above).
    assert (
        dict(ours.attributes or {}).items()
        >= {
            "rpc.system": "grpc",
            "rerank.pairs": 40,
            "rerank.scored": 39,
            "rerank.ratio": 0.5,
            "rerank.ok": True,
            "rerank.ids": (1, 2),
        }.items()
    )
    assert ours.start_time is not None and ours.end_time is not None
    assert ours.start_time <= ours.end_time
    # ... and it leaves the process as OTLP, as the batch processor's exporter sends it.
    (resource,) = encode_spans([ours]).resource_spans
    (encoded,) = resource.scope_spans[0].spans
    assert encoded.name == "renamed" and encoded.trace_id == TRACE_ID.to_bytes(16, "big")
    assert {a.key for a in encoded.attributes} == set(ours.attributes or {})


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
@pytest.mark.parametrize(
    "parent, recorded",
    [(None, True), (True, True), (False, False)],
    ids=["root", "sampled-parent", "unsampled-parent"],
)
def test_the_default_sampler_follows_the_parent(
    lean: bool, parent: bool | None, recorded: bool
) -> None:
    tracer, exporter = _tracer(lean)
    context = None if parent is None else _remote(parent)
    span = tracer.start_span("s", context=context, attributes={"a": 1})
    assert span.is_recording() is recorded
    assert span.get_span_context().trace_id == TRACE_ID
    assert span.get_span_context().trace_flags.sampled is recorded
    span.end()
    assert len(exporter.get_finished_spans()) == int(recorded)


def test_a_configured_sampler_decides() -> None:
    tracer, exporter = _tracer(sampler=TraceIdRatioBased(0.0))
    span = tracer.start_span("s")
    span.end()
    assert not span.is_recording() and exporter.get_finished_spans() == ()


def test_non_default_span_limits_keep_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lean span does not truncate, so limits set in the environment leave spans to the
    SDK, which applies them."""
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "1")
    tracer, exporter = _tracer()
    assert isinstance(tracer, SdkTracer)
    tracer.start_span("s", attributes={"a": 1, "b": 2}).end()
    (span,) = exporter.get_finished_spans()
    assert span.dropped_attributes == 1


def test_a_disabled_sdk_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracer, exporter = _tracer()
    assert isinstance(tracer, trace.NoOpTracer)
    tracer.start_span("s").end()
    assert exporter.get_finished_spans() == ()


def test_current_span_records_an_escaping_exception() -> None:
    tracer, exporter = _tracer()
    with pytest.raises(RuntimeError), tracer.start_as_current_span("step") as span:
        assert trace.get_current_span() is span
        child = tracer.start_span("child")
        child.end()
        raise RuntimeError("boom")
    assert trace.get_current_span() is trace.INVALID_SPAN
    child_span, step = exporter.get_finished_spans()
    assert child_span.parent == step.context
    assert step.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in step.events] == ["exception"]
    assert step.events[0].attributes is not None
    assert step.events[0].attributes["exception.type"] == "RuntimeError"


class _Reading(SimpleSpanProcessor):
    """A processor that reads the span it is handed at the start, as the SDK allows."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        super().__init__(exporter)
        self.started: list[tuple[str, dict[str, object], trace.SpanKind]] = []

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        self.started.append((span.name, dict(span.attributes or {}), span.kind))


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
def test_a_processor_reads_the_span_at_its_start(lean: bool) -> None:
    exporter = InMemorySpanExporter()
    processor = _Reading(exporter)
    provider = TracerProvider(id_generator=_Counting())
    if lean:
        tracer = lean_tracer(provider, processor, "rerank_server", "1.0")
    else:
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("rerank_server", "1.0")
    tracer.start_span("s", kind=trace.SpanKind.SERVER, attributes={"a": 1}).end()
    assert processor.started == [("s", {"a": 1}, trace.SpanKind.SERVER)]


def _links_and_escape(tracer: trace.Tracer) -> None:
    valid = trace.SpanContext(TRACE_ID, 0xABC, is_remote=True)
    links = [trace.Link(valid, {"k": 1}), trace.Link(trace.INVALID_SPAN_CONTEXT)]
    with pytest.raises(KeyError), tracer.start_span("s", links=links) as span:
        span.add_link(trace.INVALID_SPAN_CONTEXT, {"why": "attributes keep it"})
        span.add_link(trace.INVALID_SPAN_CONTEXT)  # dropped
        raise KeyError("gone")


def test_links_and_an_exception_leaving_the_span_as_the_sdk_records_them() -> None:
    """`with tracer.start_span(...)`: the exception is recorded and the status set."""
    lean, lean_spans = _tracer()
    sdk, sdk_spans = _tracer(lean=False)
    _links_and_escape(lean)
    _links_and_escape(sdk)
    (ours,), (theirs,) = lean_spans.get_finished_spans(), sdk_spans.get_finished_spans()
    mine, other = _fields(ours), _fields(theirs)
    assert mine[:5] + mine[6:] == other[:5] + other[6:]
    assert [e[:2] for e in mine[5]] == [e[:2] for e in other[5]]  # all but the time
    assert [(link.context, dict(link.attributes or {})) for link in ours.links] == [
        (link.context, dict(link.attributes or {})) for link in theirs.links
    ]
    assert len(ours.links) == 2
    assert ours.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in ours.events] == ["exception"]
