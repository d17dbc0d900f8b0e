"""Best-chunk selection: cut a long document to the window that best matches the query.

A cross-encoder reads a bounded number of tokens, and a long document's relevant passage
is often far from its start. We split the document into sentences (hard-wrapping any
sentence longer than the window at word boundaries), slide a window of whole consecutive
pieces no longer than `max_chars`, and keep the window with the highest query-term score.

A term's weight is its inverse document frequency over the request's candidates, so a
query word every candidate contains ("the", "what") counts for little and a rare one
decides. Repeats count with diminishing returns (log). Ties go to the earliest window, so
the choice is deterministic; with no query term anywhere, the document's start wins.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..domain import Candidate

_WORD = re.compile(r"\w+", re.UNICODE)
# Sentence ends: ., ! or ? followed by space, or any line break run.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*")


def terms(text: str) -> list[str]:
    """Lower-cased word tokens; single characters carry too little to match on."""
    return [t for t in _WORD.findall(text.lower()) if len(t) > 1]


def query_term_weights(query: str, documents: Iterable[str]) -> dict[str, float]:
    """BM25-style IDF of each query term over `documents` (the request's candidates)."""
    query_terms = set(terms(query))
    if not query_terms:
        return {}
    doc_freq: Counter[str] = Counter()
    n = 0
    for doc in documents:
        n += 1
        doc_freq.update(query_terms.intersection(terms(doc)))
    return {t: math.log(1.0 + (n - doc_freq[t] + 0.5) / (doc_freq[t] + 0.5)) for t in query_terms}


def _pieces(text: str, max_chars: int) -> list[tuple[int, int]]:
    """(start, end) spans of sentences, each at most `max_chars` long, in order."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if match.start() > start:
            spans.append((start, match.start()))
        start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    out: list[tuple[int, int]] = []
    for s, e in spans:
        while e - s > max_chars:
            # Hard-wrap at the last space inside the limit, or mid-word if there is none.
            cut = text.rfind(" ", s + 1, s + max_chars + 1)
            cut = cut if cut > s else s + max_chars
            out.append((s, cut))
            s = cut
            while s < e and text[s].isspace():
                s += 1
        if e > s:
            out.append((s, e))
    return out


def best_chunk(text: str, max_chars: int, weights: Mapping[str, float]) -> str:
    """The window of `text` (at most `max_chars` long) with the highest query-term score.

    Texts that already fit are returned whole. The window is a substring of `text`
    spanning whole pieces, so it starts and ends on sentence boundaries where the text
    has them.
    """
    if len(text) <= max_chars:
        return text
    pieces = _pieces(text, max_chars)
    if not pieces:
        return text[:max_chars]
    counts = [Counter(t for t in terms(text[s:e]) if t in weights) for s, e in pieces]

    best_score, best_span = -1.0, pieces[0]
    window: Counter[str] = Counter()
    hi = 0  # pieces[lo:hi] is the current window
    for lo in range(len(pieces)):
        if hi < lo + 1:
            window = Counter(counts[lo])
            hi = lo + 1
        while hi < len(pieces) and pieces[hi][1] - pieces[lo][0] <= max_chars:
            window.update(counts[hi])
            hi += 1
        score = _score(window, weights)
        if score > best_score:
            best_score, best_span = score, (pieces[lo][0], pieces[hi - 1][1])
        window.subtract(counts[lo])
    return text[best_span[0]:best_span[1]]


def _score(window: Counter[str], weights: Mapping[str, float]) -> float:
    return sum(weights[t] * math.log1p(c) for t, c in window.items() if c > 0)


def select_chunks(query: str, texts: Sequence[str], max_chars: int) -> list[str]:
    """Best chunk of every text, with term weights computed over all of them."""
    if all(len(t) <= max_chars for t in texts):
        return list(texts)
    weights = query_term_weights(query, texts)
    return [best_chunk(t, max_chars, weights) for t in texts]


def document_texts(query: str, candidates: Sequence[Candidate], max_chars: int,
                   ) -> tuple[list[str], int]:
    """What the scorer reads for each candidate (its title line, then its best chunk), and
    how many documents were cut."""
    chunks = select_chunks(query, [c.text for c in candidates], max_chars)
    texts = [f"{c.title}\n{chunk}" if c.title else chunk
             for chunk, c in zip(chunks, candidates, strict=True)]
    return texts, sum(len(chunk) < len(c.text) for chunk, c in zip(chunks, candidates,
                                                                    strict=True))
