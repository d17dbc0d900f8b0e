"""The writing system a request is mostly in, for blend profiles that name the scripts
their model reads (docs/blending.md, "Scripts").
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

# What is read of a request: the query and the head of each of its first documents,
# enough to tell the script of any real request at a small, fixed cost.
DOCUMENT_CHARS = 256
DOCUMENTS = 20
LATIN = "Latin"


def reads(scripts: Sequence[str], script: str) -> bool:
    """Whether a model that reads `scripts` (none named: any) reads text mostly in
    `script` ("": no letters at all, so nothing it cannot read)."""
    return not scripts or not script or script in scripts


@lru_cache(maxsize=4096)
def script_of(char: str) -> str:
    """The script of one letter, as `Latin`, `Arabic`, `Han`, ...; "" for none."""
    name = unicodedata.name(char, "")
    first = name.split(" ", 1)[0]
    return "Han" if first == "CJK" else first.title()


def dominant_script(query: str, documents: Iterable[str]) -> str:
    """The script most of the request's letters are in; "" when it has none. Text that
    is all ASCII (`str.isascii` is a flag CPython keeps) is Latin without a look."""
    texts = [
        query,
        *(d[:DOCUMENT_CHARS] for _, d in zip(range(DOCUMENTS), documents, strict=False)),
    ]
    if all(t.isascii() for t in texts):
        return LATIN
    counts: Counter[str] = Counter()
    for text in texts:
        if text.isascii():
            counts[LATIN] += sum(map(str.isalpha, text))
            continue
        for char in text:
            if char.isalpha():
                counts[script_of(char)] += 1
    counts.pop("", None)
    return counts.most_common(1)[0][0] if counts else ""
