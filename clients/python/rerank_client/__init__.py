"""Typed client for rerank-server (gRPC `rerank.v1.Reranker`)."""

from .client import AsyncRerankClient, InsecureTokenWarning, RerankClient, channel_options
from .errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RerankError,
    ServerBusyError,
    UnavailableError,
)
from .types import (
    Candidate,
    CandidateLike,
    RankedList,
    RerankAnswer,
    Result,
    Summary,
    Threshold,
    ThresholdReport,
)

__all__ = [
    "AsyncRerankClient",
    "Candidate",
    "CandidateLike",
    "DeadlineExceededError",
    "InsecureTokenWarning",
    "InvalidRequestError",
    "ModelNotFoundError",
    "RankedList",
    "RerankAnswer",
    "RerankClient",
    "RerankError",
    "Result",
    "ServerBusyError",
    "Summary",
    "Threshold",
    "ThresholdReport",
    "UnavailableError",
    "channel_options",
]
__version__ = "0.1.0"
