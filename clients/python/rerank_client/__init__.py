"""Typed client for rerank-server (gRPC `rerank.v1.Reranker`)."""

from .client import AsyncRerankClient, RerankClient, channel_options
from .errors import (
    DeadlineExceededError,
    InvalidRequestError,
    RerankError,
    ServerBusyError,
    UnavailableError,
)
from .types import Candidate, CandidateLike, RerankAnswer, Result, Summary

__all__ = [
    "AsyncRerankClient",
    "Candidate",
    "CandidateLike",
    "DeadlineExceededError",
    "InvalidRequestError",
    "RerankAnswer",
    "RerankClient",
    "RerankError",
    "Result",
    "ServerBusyError",
    "Summary",
    "UnavailableError",
    "channel_options",
]
__version__ = "0.1.0"
