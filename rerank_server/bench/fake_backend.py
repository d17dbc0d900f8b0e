"""An instant scoring backend for overhead benchmarks, speaking every backend's protocol.

    python -m rerank_server.bench.fake_backend --port 8099

It answers at once with a fixed-shape answer, so what a benchmark measures through it is
rerank-server's own cost (or after `--latency-ms`, a model's fixed time per call, for the
streaming scenario). It runs as a process of its own, so its CPU time is not counted
as ours. Scores are a stable function of the text. Not a test double for correctness:
tests use `tests/fakes/`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _score(text: str) -> float:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big") / 2**32


def _logprobs(p: float) -> list[dict[str, Any]]:
    import math
    return [{"id": 1, "token": "yes", "logprob": math.log(max(p, 1e-6))},
            {"id": 2, "token": "no", "logprob": math.log(max(1 - p, 1e-6))}]


def answer(path: str, body: Any) -> Any:
    if path == "/v1/chat/completions":
        # The user's message holds the document (the last one may be the assistant's
        # prefill, the same for every pair).
        content = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if "JSON array" in body["messages"][0]["content"]:  # the llm backend
            n = content.count("\n[")
            scores = [{"index": i, "score": round(_score(f"{i}{content}"), 3)}
                      for i in range(1, n + 1)]
            return {"choices": [{"message": {"role": "assistant",
                                             "content": json.dumps(scores)}}]}
        return {"model": "instant", "choices": [{"logprobs": {"content": [
            {"token": "yes", "logprob": 0.0, "top_logprobs": _logprobs(_score(content))}]}}]}
    if path == "/completion":
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        return [{"completion_probabilities": [{"top_logprobs": _logprobs(_score(p))}]}
                for p in prompts]
    if path == "/tokenize":
        return {"tokens": [1] if body["content"].strip().lower() == "yes" else [2]}
    if path == "/apply-template":
        m = body["messages"]
        return {"prompt": f"<s>{m[0]['content']}\n{m[1]['content']}\n<a>"}
    if path in ("/v1/rerank", "/rerank"):
        if "texts" in body:
            return [{"index": i, "score": _score(t)} for i, t in enumerate(body["texts"])]
        return {"results": [{"index": i, "relevance_score": _score(t)}
                            for i, t in enumerate(body["documents"])]}
    if path == "/v1/embeddings":
        return {"data": [{"index": i, "embedding": [_score(t), 1.0, 0.5]}
                         for i, t in enumerate(body["input"])]}
    if path == "/api/generate":
        return {"response": str(round(_score(body["prompt"]) * 10)), "done": True}
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    latency_s = 0.0  # per scoring call

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"data": [{"id": "instant"}]})
        else:
            self._send(200, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        payload = answer(self.path, body)
        if self.latency_s and self.path not in ("/tokenize", "/apply-template"):
            time.sleep(self.latency_s)
        self._send(404, {"error": "not found"}) if payload is None else self._send(200, payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="sleep this long before answering each scoring call")
    args = parser.parse_args()
    Handler.latency_s = args.latency_ms / 1000
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
