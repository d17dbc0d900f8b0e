"""The ranking core: validate, shape, chunk, cache, score, blend, emit.

No protobuf, no grpc, no network: scores come only through the `Scorer` protocol.
"""
