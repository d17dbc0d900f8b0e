"""The client's exceptions: a small set that callers can act on, mapped from gRPC status."""

from __future__ import annotations

import grpc

from .pb import rerank_pb2 as pb


class RerankError(Exception):
    """A call failed. `code` is the gRPC status name, e.g. "INTERNAL"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidRequestError(RerankError):
    """The request broke a rule (INVALID_ARGUMENT); the message names the field. Fix it."""


class ModelNotFoundError(RerankError):
    """The request named a model the server does not serve (NOT_FOUND); the message
    lists those it does."""


class ServerBusyError(RerankError):
    """The server is shedding load (RESOURCE_EXHAUSTED). Retry later, with back-off."""


class UnavailableError(RerankError):
    """The server cannot be reached or is draining (UNAVAILABLE). Retry elsewhere."""


class DeadlineExceededError(RerankError):
    """The call's deadline passed before the answer came (DEADLINE_EXCEEDED)."""


_BY_CODE: dict[grpc.StatusCode, type[RerankError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServerBusyError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def from_batch_error(error: pb.RequestError) -> RerankError:
    """The exception for a request that `RerankBatch` rejected (its `error` field)."""
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    return from_code(code, error.message)


def from_code(code: grpc.StatusCode, message: str) -> RerankError:
    return _BY_CODE.get(code, RerankError)(code.name, message)


def from_rpc_error(error: grpc.RpcError) -> RerankError:
    """The client exception for a failed call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return from_code(code, details or "")
