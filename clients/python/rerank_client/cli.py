"""`rerank-client`: rerank documents from the command line and print a ranked table.

    rerank-client "what is a cross-encoder?" "doc one" "doc two"
    rerank-client --file candidates.jsonl --top-k 5 --json "my query"

A JSONL line is either a JSON string (the text) or an object with `text` and optionally
`id`, `title`, `retrieval_score`, `retrieval_rank`, `metadata`. `--file -` reads stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

from .client import RerankClient
from .errors import RerankError
from .types import BLEND_STRATEGIES, CandidateLike, RerankAnswer, Result, Summary, to_candidate

DEFAULT_TARGET = "127.0.0.1:50051"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rerank-client",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("query", help="the query")
    p.add_argument("documents", nargs="*", help="candidate texts, in retrieval order")
    p.add_argument(
        "--target",
        default=os.environ.get("RERANK_TARGET", DEFAULT_TARGET),
        help="server address host:port [env RERANK_TARGET]",
    )
    p.add_argument("--file", help="JSONL file of candidates ('-' for stdin)")
    p.add_argument("--top-k", type=int, default=0, help="results to return (0: all)")
    p.add_argument("--instruction", help="task instruction for the scorer")
    p.add_argument("--model", default="", help="the served model to rank with, by name")
    p.add_argument("--blend", choices=sorted(BLEND_STRATEGIES), help="blend strategy")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    p.add_argument(
        "--always-score",
        action="store_true",
        help="score even when the blend gives the model no weight, to see its scores",
    )
    p.add_argument(
        "--stream", action="store_true", help="use RerankStream and print results as they arrive"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--token",
        default=os.environ.get("RERANK_TOKEN"),
        help="bearer token for a server run with --auth-tokens (env RERANK_TOKEN)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("RERANK_CLIENT_CA"),
        help="PEM CA to verify the server with; turns TLS on (env RERANK_CLIENT_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=os.environ.get("RERANK_CLIENT_CERT"),
        help="client certificate for mutual TLS (env RERANK_CLIENT_CERT)",
    )
    p.add_argument(
        "--tls-key",
        default=os.environ.get("RERANK_CLIENT_KEY"),
        help="client key for mutual TLS (env RERANK_CLIENT_KEY)",
    )
    return p


def _read_jsonl(stream: TextIO) -> list[CandidateLike]:
    out: list[CandidateLike] = []
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"rerank-client: line {n}: not JSON ({exc.msg})") from None
        if not isinstance(item, str | dict):
            raise SystemExit(f"rerank-client: line {n}: expected a string or an object")
        out.append(item)
    return out


def _snippet(text: str | None, width: int = 60) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _row(r: Result, texts: Sequence[str]) -> str:
    rr = "-" if r.reranker_score is None else f"{r.reranker_score:.4f}"
    text = texts[r.index] if r.index < len(texts) else ""
    return (
        f"{r.rank:>4}  {r.id:<12} {r.score:>8.4f} {rr:>8} {r.retrieval_rank:>5}  {_snippet(text)}"
    )


HEADER = f"{'rank':>4}  {'id':<12} {'score':>8} {'reranker':>8} {'retr':>5}  text"


def _summary_line(s: Summary) -> str:
    state = "reranked" if s.reranked else "NOT reranked"
    blend = f"{s.blend_strategy} {s.blend_profile}" if s.blend_profile else s.blend_strategy
    line = (
        f"{state} by {s.backend or '-'} ({s.model or 'unknown model'}), blend "
        f"{blend}: scored {s.scored}/{s.submitted} of {s.candidates} "
        f"candidates in {s.total_ms:.0f} ms"
    )
    reasons = s.degraded_reasons or (
        ((s.degraded_code, s.degraded_message or ""),) if s.degraded_code else ()
    )
    for code, message in reasons:
        line += f"\ndegraded: {code}: {message}"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    candidates: list[CandidateLike] = list(args.documents)
    if args.file:
        if args.file == "-":
            candidates += _read_jsonl(sys.stdin)
        else:
            try:
                with open(args.file, encoding="utf-8") as fh:
                    candidates += _read_jsonl(fh)
            except (OSError, UnicodeDecodeError) as exc:
                raise SystemExit(f"rerank-client: --file {args.file}: {exc}") from None
    if not candidates:  # nothing to rank: an empty table said nothing of why
        raise SystemExit(
            "rerank-client: no documents: give them after the query, or --file CANDIDATES.jsonl"
        )
    options: dict[str, Any] = {
        "top_k": args.top_k,
        "instruction": args.instruction,
        "model": args.model,
        "blend_strategy": args.blend,
        "always_score": args.always_score,
    }
    try:
        texts = [to_candidate(c, i).text for i, c in enumerate(candidates)]
    except TypeError as exc:
        raise SystemExit(f"rerank-client: bad candidate: {exc}") from None
    try:
        with RerankClient(
            args.target,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ) as client:
            if args.stream:
                return _print_stream(client, args, candidates, texts, options)
            answer = client.rerank(args.query, candidates, timeout=args.timeout, **options)
    except RerankError as exc:
        print(f"rerank-client: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as exc:
        # The command line's fault, found while building the call: a TLS file that is not
        # there, a client certificate without its CA, a candidate field of the wrong type.
        print(f"rerank-client: {exc}", file=sys.stderr)
        return 1
    _print_answer(answer, texts, args.json)
    return 0


def _print_answer(answer: RerankAnswer, texts: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {"results": [asdict(r) for r in answer.results], "summary": asdict(answer.summary)},
                indent=2,
                default=dict,
            )
        )
        return
    print(HEADER)
    for r in answer.results:
        print(_row(r, texts))
    print(_summary_line(answer.summary))


def _print_stream(
    client: RerankClient,
    args: argparse.Namespace,
    candidates: Sequence[CandidateLike],
    texts: Sequence[str],
    options: dict[str, Any],
) -> int:
    if not args.json:
        print(HEADER)
    for item in client.stream(args.query, candidates, timeout=args.timeout, **options):
        if isinstance(item, Result):
            print(
                json.dumps(asdict(item), default=dict) if args.json else _row(item, texts),
                flush=True,
            )
        else:
            print(json.dumps({"summary": asdict(item)}) if args.json else _summary_line(item))
    return 0


if __name__ == "__main__":
    sys.exit(main())
