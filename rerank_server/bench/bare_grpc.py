"""The floor under every overhead figure: a bare `grpc.aio` server answering `Rerank`.

Run as `python -m rerank_server.bench.bare_grpc --port 50099`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc

from ..api.pb import rerank_pb2 as pb
from ..loops import loop_factory

_ANSWERS: dict[int, bytes] = {}


def answer(count: int) -> bytes:
    """A `RerankResponse` shaped like rerank-server's for `count` candidates."""
    if count not in _ANSWERS:
        response = pb.RerankResponse(
            request_id="bare",
            reranked=True,
            backend="bare",
            model="bare",
            blend_strategy=pb.BLEND_STRATEGY_ADAPTIVE,
            counts=pb.Counts(candidates=count, submitted=count, scored=count),
            timings=pb.Timings(total_ms=1.0, scoring_ms=0.5),
        )
        for i in range(count):
            response.results.add(
                id=str(i),
                index=i,
                rank=i + 1,
                score=1.0 - i / (count + 1),
                reranker_score=0.5,
                retrieval_rank=i + 1,
            )
        _ANSWERS[count] = response.SerializeToString()
    return _ANSWERS[count]


async def rerank(raw: bytes, _context: Any) -> bytes:
    """As rerank-server's edge takes a request (bytes, parsed here), answered with a
    prebuilt response of as many results: what is left is the gRPC hop alone."""
    return answer(len(pb.RerankRequest.FromString(raw).candidates))


async def serve(port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "rerank.v1.Reranker", {"Rerank": grpc.unary_unary_rpc_method_handler(rerank)}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop where installed
        runner.run(serve(args.port))


if __name__ == "__main__":
    main()
