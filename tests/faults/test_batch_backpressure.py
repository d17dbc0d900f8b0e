"""RerankBatch whose client writes requests and does not read answers: the server's
memory stays flat.

The server keeps at most `--batch-concurrency` answers queued and as many requests in
progress; a slot is freed only when its answer is queued, and the queue empties only as
fast as gRPC takes answers. How much gRPC takes is the client's HTTP/2 receive window,
which grpc clients grow to many MB on loopback, so the answers pile up on the client's
side, not the server's (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from rerank_server.api.pb import rerank_pb2 as pb
from rerank_server.api.pb import rerank_pb2_grpc as pb_grpc
from tests.fakes.llama import FakeLlamaServer
from tests.server_process import server_process

REQUESTS = 1500  # answers of about 36 KB: 54 MB unread


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_unread_answers_do_not_grow_server_memory(fake_llama: FakeLlamaServer) -> None:
    candidates = [pb.Candidate(id=str(i), text=f"passage {i}. " + "word " * 2400) for i in range(3)]

    async def requests() -> AsyncIterator[pb.RerankRequest]:
        for i in range(REQUESTS):
            yield pb.RerankRequest(
                request_id=str(i),
                query=f"q{i}",
                candidates=candidates,
                options=pb.RerankOptions(return_text=True),
            )

    async with (
        server_process(fake_llama.url, RERANK_PROBE="0") as (port, proc),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        warm = pb_grpc.RerankerStub(channel).Rerank(
            pb.RerankRequest(query="warm up", candidates=candidates)
        )
        assert (await warm).reranked
        before = rss_mib(proc.pid)
        call = pb_grpc.RerankerStub(channel).RerankBatch(requests())
        peak = before
        for _ in range(40):  # 8 s of writing and not reading
            await asyncio.sleep(0.2)
            peak = max(peak, rss_mib(proc.pid))
        scored = len(fake_llama.requests) // len(candidates)
        first = await call.read()
        call.cancel()
    print(f"batch unread: {scored} requests scored, server RSS {before:.0f} -> {peak:.0f} MiB")
    assert scored > 200, "the test did not load the server"
    assert peak - before < 40, f"server RSS grew {peak - before:.0f} MiB with answers unread"
    assert isinstance(first, pb.RerankResponse) and first.reranked
