"""The JSON shapes of the HTTP API (pydantic): what the OpenAPI document is made from.

Cohere/Jina fields keep their names and meaning; our extras are optional.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

INT64_MAX = 2**63 - 1  # the proto's widest integer field


def _integral(value: object) -> object:
    """A float with nothing after the point as the int it is: Python's `json.dumps` writes
    `1.5 * 1000` as `1500.0`, and strict mode alone would refuse it. No whole number
    beyond 64 bits: JSON has no bound, and one of 400 digits overflowed float arithmetic
    (a 500 instead of a 422 naming the field)."""
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is int and abs(value) > INT64_MAX:
        raise ValueError(f"must be at most {INT64_MAX} in size")
    return value


# A request's whole numbers: strict (no "2", no true), but 2.0 is 2.
Count = Annotated[int, BeforeValidator(_integral)]
# A field name in `rank_fields`: a document object's key, quoted back in messages and log
# lines, so their length is capped like every other input's.
MAX_FIELD_NAME_CHARS = 256

BlendName = Literal["position_aware", "linear", "rerank_only", "adaptive", "profile"]


class Document(BaseModel):
    """A document as an object: `text` (or the `rank_fields`), plus our optional extras."""

    model_config = ConfigDict(extra="allow", strict=True)

    text: str | None = Field(None, description="The document text.")
    title: str | None = Field(None, description="Extra: a title, read before the text.")
    id: str | None = Field(None, description="Extra: your id for it; default its index.")
    retrieval_score: float | None = Field(None, description="Extra: its retrieval score.")
    retrieval_rank: Count | None = Field(
        None, ge=1, description="Extra: its retrieval rank; default its position + 1."
    )


class Extras(BaseModel):
    """What rerank-server adds to the Cohere request; all optional."""

    # Strict, as every request model here: JSON's own types only, so `"top_n": "2"`,
    # `2.0` or `true`, and `"return_documents": "yes"` are refused, named, rather than
    # read as something the caller may not have meant (an int is still a float).
    model_config = ConfigDict(strict=True)

    instruction: str | None = Field(None, description="Task instruction for the scorer.")
    blend_strategy: BlendName | None = Field(
        None,
        description="How the model's score and the retrieval rank combine "
        "(docs/blending.md); default: the server's `--http-blend-strategy`, `rerank_only` "
        "unless set: the model's order, `relevance_score` the model's score.",
    )
    request_id: str | None = Field(None, description="Echoed as `id`; generated if unset.")
    max_candidates: Count | None = Field(None, ge=1, description="Documents scored at most.")
    timeout_ms: Count | None = Field(None, ge=1, description="Time budget for this request.")
    always_score: bool = Field(
        False,
        description="Score even when the blend gives the reranker no weight, to get "
        "`reranker_score`s (docs/blending.md).",
    )


class CohereRerankRequest(Extras):
    """A Cohere/Jina rerank request (`/v1/rerank`, `/v2/rerank`); unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    query: str = Field(description="The search query.")
    documents: list[str | Document] = Field(
        description="Candidates in retrieval order, as strings or objects."
    )
    model: str | None = Field(
        None,
        description="The served model to rank with, by name or alias. With one model "
        "served any name is accepted; with several, absent means the default and an "
        "unknown name is 404, listing the served names (docs/models.md).",
    )
    top_n: Count | None = Field(None, ge=0, description="Results to return; default all.")
    return_documents: bool | None = Field(
        None, description="Include each document as sent (on /v1 and /v2; null: no)."
    )
    rank_fields: list[Annotated[str, Field(max_length=MAX_FIELD_NAME_CHARS)]] | None = Field(
        None,
        max_length=64,  # read for every document: a long list is work per document
        description="v1: the fields of object documents to read, as `field: value` "
        f"(at most 64, each at most {MAX_FIELD_NAME_CHARS} characters).",
    )
    max_tokens_per_doc: Count | None = Field(
        None, ge=1, description="Most tokens of each document the model reads."
    )
    max_chunks_per_doc: Count | None = Field(None, description="v1: accepted and ignored.")


RELEVANCE = (
    "Results are sorted by it. Under `rerank_only` (the default) the model's own score "
    "on 0..1, so a threshold keeps exactly what the model scored at or above it; 0 for a "
    "document the model did not score, which follows every scored one. Under another "
    "blend (`meta.blend_strategy`) the blended score (docs/http.md)."
)


class CohereResult(BaseModel):
    """One ranked document of a Cohere/Jina answer."""

    index: int = Field(description="Position of the document in the request.")
    relevance_score: float = Field(description=RELEVANCE)
    # A plain object, not a model: the answer leaves out fields that are None, and a model
    # would lose the fields the caller sent as null with them.
    document: dict[str, Any] | None = Field(
        None,
        description='With `return_documents`: the document as sent, `{"text": ...}` '
        "for a string and every field of an object, nulls included.",
    )
    id: str = Field(description="Extra: the document's id (its index unless given).")
    reranker_score: float | None = Field(
        None, description="Extra: the model's own score on 0..1; absent if not scored."
    )
    retrieval_rank: int = Field(description="Extra: the document's retrieval rank.")


class Degraded(BaseModel):
    """Why an answer is not fully reranked: a code and a message."""

    code: str
    message: str


class ApiVersion(BaseModel):
    """The Cohere API version an answer follows."""

    version: str


class BilledUnits(BaseModel):
    """Cohere's billing count: one search unit per request."""

    search_units: int


class Meta(BaseModel):
    """What a Cohere/Jina answer says about how it was ranked."""

    api_version: ApiVersion
    billed_units: BilledUnits
    reranked: bool = Field(
        description="Extra: false means the results are in retrieval order; `degraded` says why."
    )
    degraded: Degraded | None = None
    degraded_reasons: list[Degraded] | None = Field(
        None,
        description="Extra: every reason the answer degraded, `degraded` first "
        "(an answer can be both `partial` and `capped`).",
    )
    backend: str
    model: str
    blend_strategy: str
    blend_profile: str | None = None
    scored: int
    failed: int


class CohereRerankResponse(BaseModel):
    """A Cohere/Jina rerank answer: the results in final order, and `meta`."""

    id: str
    results: list[CohereResult]
    meta: Meta


class TeiRerankRequest(BaseModel):
    """A TEI rerank request (`/rerank`); unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    query: str
    texts: list[str]
    raw_scores: bool = Field(
        False, description="Accepted: `score` is the model's own score either way (docs/http.md)."
    )
    return_text: bool = False
    truncate: bool = Field(
        False, description="Accepted: documents are always cut to fit the model's context."
    )
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"


class TeiResult(BaseModel):
    """One ranked text of a TEI answer."""

    index: int
    score: float = Field(description=RELEVANCE)
    text: str | None = None


def _root_shape(body: Any) -> str:
    """TEI's body names its documents `texts`; Cohere's, Infinity's and vLLM's `documents`."""
    fields = body if isinstance(body, dict) else vars(body)
    return "tei" if "texts" in fields or "documents" not in fields else "cohere"


# `POST /rerank`: TEI's body, or the Cohere-style one Infinity and vLLM clients send there.
RootRerankRequest = Annotated[
    Annotated[TeiRerankRequest, Tag("tei")] | Annotated[CohereRerankRequest, Tag("cohere")],
    Discriminator(_root_shape),
]


class ModelCard(BaseModel):
    """A served model, as an OpenAI-style model entry."""

    id: str
    object: Literal["model"] = "model"
    owned_by: str = "rerank-server"
    backend: str
    aliases: list[str] | None = Field(None, description="Other names it answers to.")


class ModelList(BaseModel):
    """`GET /v1/models`: every served model, the default first."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


BackendState = Literal["up", "down", "starting"]


class Health(BaseModel):
    """`GET /health`: whether the server answers, and its backend's state."""

    status: Literal["ok", "unavailable"]
    backend: BackendState = Field(description="The default model's backend.")
    model: str = Field(description="The default model; empty when tokens are required.")
    models: dict[str, BackendState] | None = Field(
        None, description="With several models served: each one's backend state."
    )


class Error(BaseModel):
    """An error answer: `{"message": ...}`, naming the field at fault where there is one."""

    message: str
