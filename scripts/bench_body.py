"""CPU to take a rerank body from bytes to the validated request model.

Usage: python scripts/bench_body.py

What the JSON edge does per request before conversion: the gate's decode (`wire.py`)
and the pydantic validation FastAPI runs on its result (`route.py`), for Cohere bodies
of 10, 40 and 100 documents of about 1 KiB. The best of seven repeats of 200 each.
"""

from __future__ import annotations

import json
import timeit

from pydantic import TypeAdapter

from rerank_server.http_api import models, wire
from rerank_server.server import request_rules
from rerank_server.settings import load


def main() -> None:
    rules = request_rules(load([], {}))
    adapter = TypeAdapter(models.CohereRerankRequest)
    for size in (10, 40, 100):
        documents = [
            {"text": f"word{i} " * 170, "id": f"d{i}", "retrieval_rank": i + 1} for i in range(size)
        ]
        body = json.dumps({"query": "what is it", "documents": documents, "top_n": 5}).encode()

        def once(body: bytes = body) -> None:
            adapter.validate_python(wire.decoded("/v1/rerank", body, rules))

        best = min(timeit.repeat(once, number=200, repeat=7)) / 200
        print(f"{size:4d} documents {len(body) / 1024:7.1f} KiB {best * 1e6:8.1f} µs")


if __name__ == "__main__":
    main()
