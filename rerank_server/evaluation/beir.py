"""A data set in BEIR layout: `corpus.jsonl`, `queries.jsonl`, `qrels.tsv`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    """One corpus document: its id, title (may be empty) and text."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Dataset:
    """A loaded data set: the corpus, the judged queries and their judgements."""

    name: str
    corpus: list[Document]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


class DatasetError(ValueError):
    """The folder is not a usable BEIR-layout data set; the message says why."""


def load(path: Path) -> Dataset:
    """The data set in the folder `path`; DatasetError naming what is missing or wrong.

    `corpus.jsonl` lines hold `_id`, `title` (may be empty) and `text`; `queries.jsonl`
    lines `_id` and `text`; `qrels.tsv` holds `query-id`, `corpus-id`, `score`,
    tab-separated, with or without a header line. Only queries with at least one judged
    document take part (as BEIR's own loader does).
    """
    for name in ("corpus.jsonl", "queries.jsonl", "qrels.tsv"):
        if not (path / name).exists():
            raise DatasetError(f"{path}: no {name} (BEIR layout expected)")
    corpus = [
        Document(str(d["_id"]), d.get("title") or "", d["text"])
        for d in _jsonl(path / "corpus.jsonl")
    ]
    qrels: dict[str, dict[str, int]] = {}
    for n, line in enumerate((path / "qrels.tsv").read_text().splitlines(), start=1):
        parts = line.strip().split("\t")
        if not line.strip() or (n == 1 and not parts[-1].lstrip("-").isdigit()):
            continue  # blank, or the header
        if len(parts) != 3:
            raise DatasetError(f"{path / 'qrels.tsv'}:{n}: expected 3 tab-separated fields")
        qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    queries = {
        str(q["_id"]): q["text"] for q in _jsonl(path / "queries.jsonl") if str(q["_id"]) in qrels
    }
    qrels = {q: docs for q, docs in qrels.items() if q in queries}
    if not queries:
        raise DatasetError(f"{path}: no query has relevance judgements")
    return Dataset(path.name, corpus, queries, qrels)


def _jsonl(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
