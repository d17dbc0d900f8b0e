"""Best-chunk selection: cut a long document to the window that best matches the query.

How the window is chosen: docs/architecture.md, "The pipeline", step 4.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..domain import Candidate

# Han, kana, Hangul (and their compatibility forms): matched by character, not by word.
_CJK_CHARS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD = re.compile(rf"[^\W{_CJK_CHARS}]+")
_CJK = re.compile(rf"[{_CJK_CHARS}]")
_CJK_PAIR = re.compile(rf"(?=([{_CJK_CHARS}]{{2}}))")  # overlapping pairs, found in C
# Sentence ends: ., ! or ? followed by space, or any line break run; in a text that has
# them, also a full-width, Arabic or Devanagari end, space after it or not (the second
# pattern costs most texts a slower scan for nothing).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*")
_WIDE_ENDS = "。！？؟।"
_SENTENCE_END_WIDE = re.compile(rf"(?<=[.!?])\s+|(?<=[{_WIDE_ENDS}])\s*|\n\s*")
_HAS_WIDE_END = re.compile(f"[{_WIDE_ENDS}]")
# Where a sentence longer than the window may be wrapped: any space, the ideographic too.
_WRAP_AT = (" ", "\t", "\u3000", "\u00a0")
_TIE = 1e-9
PIECES_PER_WINDOW = 16
# Longer texts to cut than this in one request are cut off the event loop (`pipeline`):
# below it the work is too short to be worth a thread's hand-off, above it long enough
# to hold up other requests (docs/decisions.md, "Figures behind the code's bounds").
CHUNK_ON_LOOP_CHARS = 128 * 1024


def terms(text: str) -> list[str]:
    """Lower-cased word tokens, single letters left out (they carry too little to match
    on); then the CJK characters and their overlapping pairs."""
    lowered = text.lower()
    return (
        [t for t in _WORD.findall(lowered) if len(t) > 1]
        + _CJK.findall(lowered)
        + _CJK_PAIR.findall(lowered)
    )


def _cjk_only(query_terms: Iterable[str]) -> list[str]:
    """The CJK terms among a query's: matched in a text by counting, not by tokens (a
    query has few such terms; tokenizing every character of a document costs far more)."""
    return [t for t in query_terms if _CJK.match(t)]


def query_term_weights(query: str, documents: Iterable[str]) -> dict[str, float]:
    """BM25-style IDF of each query term over `documents` (the request's candidates)."""
    query_terms = set(terms(query))
    if not query_terms:
        return {}
    doc_freq: Counter[str] = Counter()
    n = 0
    cjk = _cjk_only(query_terms)
    for doc in documents:
        n += 1
        lowered = doc.lower()
        # The words as a set straight from the pattern: one pass in C over what can be
        # 128 KiB (a one-letter word is never a query term, so it matches nothing).
        doc_freq.update(query_terms.intersection(_WORD.findall(lowered)))
        doc_freq.update(t for t in cjk if t in lowered)
    return {t: math.log(1.0 + (n - doc_freq[t] + 0.5) / (doc_freq[t] + 0.5)) for t in query_terms}


def _pieces(text: str, max_chars: int) -> list[tuple[int, int]]:
    """(start, end) spans of the text, in order, each at most `max_chars` long: from a
    sentence start to the first sentence end at least a sixteenth of the window
    (`PIECES_PER_WINDOW`) further on, so short sentences share a piece; a span longer than
    the window is hard-wrapped at word boundaries.

    Windows thus start within a sixteenth of a sentence start, and a document has about
    16 x its length / max_chars pieces whatever its sentence count: a document of many
    tiny sentences does not become as many pieces, and the regex engine, not Python,
    skips the short ones."""
    floor = max(1, max_chars // PIECES_PER_WINDOW)
    out: list[tuple[int, int]] = []
    ends = _SENTENCE_END_WIDE if _HAS_WIDE_END.search(text) else _SENTENCE_END
    # From the first character that is not a space: a text that opened with a window's
    # worth of spaces had a blank first piece, the window chosen when nothing matched.
    pos, n = len(text) - len(text.lstrip()), len(text)
    while pos < n:
        match = ends.search(text, pos + floor)
        end, after = (match.start(), match.end()) if match else (n, n)
        s = pos
        while end - s > max_chars:
            # Hard-wrap at the last space inside the limit, or mid-word if there is none.
            cut = max(text.rfind(space, s + 1, s + max_chars + 1) for space in _WRAP_AT)
            cut = cut if cut > s else s + max_chars
            out.append((s, cut))
            s = cut
            while s < end and text[s].isspace():
                s += 1
        if end > s:
            out.append((s, end))
        pos = after
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
    counts = _piece_counts(text, pieces, weights)
    # The window's score is kept up to date as pieces enter and leave it, term by term:
    # the work is the document's matching words, once in and once out, where scoring the
    # whole window afresh at each step is pieces x distinct terms, which a hostile
    # document of short sentences made of a long query's words makes huge.
    log1p = math.log1p
    best_score, best_span = -1.0, pieces[0]
    window: dict[str, int] = {}
    score = 0.0
    hi = 0  # pieces[lo:hi] is the current window
    for lo in range(len(pieces)):
        hi = max(hi, lo)
        while hi < len(pieces) and pieces[hi][1] - pieces[lo][0] <= max_chars:
            for t, c in counts[hi].items():
                old = window.get(t, 0)
                window[t] = old + c
                score += weights[t] * (log1p(old + c) - log1p(old))
            hi += 1
        # Sums kept this way drift by rounding: windows within _TIE of each other tie,
        # and ties go to the earliest.
        if score > best_score + _TIE:
            best_score, best_span = score, (pieces[lo][0], pieces[hi - 1][1])
        for t, c in counts[lo].items():
            old = window[t]
            score += weights[t] * (log1p(old - c) - log1p(old))
            if old == c:
                del window[t]
            else:
                window[t] = old - c
        if not window:
            score = 0.0
    return text[best_span[0] : best_span[1]]


def _piece_counts(
    text: str, pieces: Sequence[tuple[int, int]], weights: Mapping[str, float]
) -> list[dict[str, int]]:
    """The query terms in each piece, counted (a piece without any: an empty dict)."""
    counts: list[dict[str, int]] = []
    cjk = _cjk_only(weights)
    for s, e in pieces:
        piece = text[s:e].lower()
        found: dict[str, int] = Counter(t for t in _WORD.findall(piece) if t in weights)
        for t in cjk:
            if times := piece.count(t):
                found[t] = times
        counts.append(found)
    return counts


def select_chunks(query: str, texts: Sequence[str], max_chars: int) -> list[str]:
    """Best chunk of every text, with term weights computed over all of them."""
    if all(len(t) <= max_chars for t in texts):
        return list(texts)
    weights = query_term_weights(query, texts)
    return [best_chunk(t, max_chars, weights) for t in texts]


def chars_to_chunk(candidates: Sequence[Candidate], max_chars: int) -> int:
    """How many characters `document_texts` will read: none when every text fits, else
    all of them (the query terms' weights are counted over every text)."""
    lengths = [len(c.text) for c in candidates]  # every request: builtins, no loop body
    return sum(lengths) if lengths and max(lengths) > max_chars else 0


def head_texts(candidates: Sequence[Candidate], max_chars: int) -> tuple[list[str], int]:
    """`document_texts` without the search: each document's first `max_chars`. For a
    request that cannot wait for the chunking thread (`pipeline`): cheap on the loop."""
    texts = [
        f"{c.title}\n{c.text[:max_chars]}" if c.title else c.text[:max_chars] for c in candidates
    ]
    return texts, sum(len(c.text) > max_chars for c in candidates)


def document_texts(
    query: str,
    candidates: Sequence[Candidate],
    max_chars: int,
) -> tuple[list[str], int]:
    """What the scorer reads for each candidate (its title line, then its best chunk), and
    how many documents were cut."""
    chunks = select_chunks(query, [c.text for c in candidates], max_chars)
    texts = [
        f"{c.title}\n{chunk}" if c.title else chunk
        for chunk, c in zip(chunks, candidates, strict=True)
    ]
    return texts, sum(len(chunk) < len(c.text) for chunk, c in zip(chunks, candidates, strict=True))
