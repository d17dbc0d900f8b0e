"""The needle case: does a blend lift a relevant document that retrieval placed low?

The requests and the rate: docs/blending.md, "The needle case".
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .beir import Dataset, Document
from .first_stage import Hit

SIZE = 20
TOP = 3


@dataclass(frozen=True)
class Needle:
    """One request: `documents` in the order sent (retrieval ranks 1..SIZE), `needle` the
    id of the relevant one."""

    qid: str
    documents: tuple[Document, ...]
    needle: str

    @property
    def position(self) -> int:
        """The needle's retrieval rank."""
        return next(i for i, d in enumerate(self.documents, 1) if d.id == self.needle)


def judges_non_relevant(dataset: Dataset) -> bool:
    """Whether the collection's judgements include grades of 0 or less."""
    return any(grade <= 0 for judged in dataset.qrels.values() for grade in judged.values())


def needles(
    dataset: Dataset, hits: dict[str, list[Hit]], size: int = SIZE, seed: int = 0
) -> list[Needle]:
    """One needle request per query that has a relevant document and `size - 1` documents
    known not to be relevant among its hits; queries in sorted order, positions drawn
    from `seed`. Those are BM25's best such hits, on the query's topic and plausible: not
    relevant means judged so where the collection grades non-relevant documents, else
    unjudged. The needle is the most relevant document the judgements name."""
    rng = random.Random(seed)
    by_id = {d.id: d for d in dataset.corpus}
    graded = judges_non_relevant(dataset)
    out = []
    for qid in sorted(hits):
        judged = dataset.qrels.get(qid, {})
        relevant = sorted((g, doc) for doc, g in judged.items() if g > 0 and doc in by_id)
        if not relevant:
            continue
        best = relevant[-1][0]
        # The most relevant grade; among those, the one BM25 ranks best (else any).
        hit_rank = {h.document.id: r for r, h in enumerate(hits[qid])}
        needle = min(
            (doc for g, doc in relevant if g == best),
            key=lambda doc: (hit_rank.get(doc, len(hit_rank)), doc),
        )
        others = [
            h.document
            for h in hits[qid]
            if (judged.get(h.document.id, 1) <= 0 if graded else h.document.id not in judged)
        ]
        if len(others) < size - 1:
            continue
        documents = others[: size - 1]
        documents.insert(rng.randrange(size // 2, size), by_id[needle])
        out.append(Needle(qid, tuple(documents), needle))
    return out


def rate(needle_ids: Sequence[str], answers: Sequence[Sequence[str]], top: int = TOP) -> float:
    """The share of answers (result ids in order) with their needle in the first `top`."""
    if not answers:
        return 0.0
    return sum(n in a[:top] for n, a in zip(needle_ids, answers, strict=True)) / len(answers)
