"""First stage: BM25 over the corpus with bm25s (Lucene's BM25 variant, English
stopwords, Snowball stemming when PyStemmer is installed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import bm25s

from .beir import Dataset, Document


@dataclass(frozen=True)
class Hit:
    """One BM25 result: the document and its score."""

    document: Document
    score: float


def bm25_top(dataset: Dataset, depth: int) -> dict[str, list[Hit]]:
    """The `depth` best documents per query, best first."""
    stemmer = _stemmer()
    texts = [f"{d.title}\n{d.text}" if d.title else d.text for d in dataset.corpus]
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stemmer=stemmer, show_progress=False), show_progress=False)
    ids = list(dataset.queries)
    tokens = bm25s.tokenize([dataset.queries[q] for q in ids], stemmer=stemmer, show_progress=False)
    k = min(depth, len(dataset.corpus))
    positions, scores = index.retrieve(tokens, k=k, show_progress=False)
    return {
        q: [
            Hit(dataset.corpus[int(p)], float(s))
            for p, s in zip(positions[row], scores[row], strict=True)
            if s > 0
        ]
        for row, q in enumerate(ids)
    }


def _stemmer() -> Any:
    try:
        import Stemmer
    except ImportError:
        return None
    return Stemmer.Stemmer("english")
