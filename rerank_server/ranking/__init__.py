"""The ranking core: validate, shape, chunk, cache, score, blend, emit.

No protobuf, no grpc and no network here: scores come only through the `Scorer` protocol
(`rerank_server.scoring.base`). A request arrives as a domain `RerankQuery`, is resolved
once against the server's defaults and limits (`validation`), and leaves as ranked
candidates and a summary (`pipeline`).
"""
