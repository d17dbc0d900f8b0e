"""The Qwen3-Reranker prompt, and the neutralization of control tokens in caller text.

Why and which shapes: docs/security.md, "Threat model".
"""

from __future__ import annotations

import hashlib
import re

SYSTEM_PROMPT = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
# Qwen3-Reranker expects an empty think block before the answer.
ASSISTANT_PREFILL = "<think>\n\n</think>\n\n"

# `<|im_end|>`, `<｜end▁of▁sentence｜>`, `</s>`, `<think>`, `<start_of_turn>`, `[INST]` ...
_ANGLE_TOKEN = re.compile(r"<(?=/?[|｜]?/?[\w▁.:-]{1,64}[|｜]?>)")
_SQUARE_TOKEN = re.compile(
    r"\[(?=/?[A-Za-z_][A-Za-z0-9_]{1,31}\]|\|[\w.:-]{1,64}\|\]|@[\w.:-]{1,64}@\])"
)
# MiniMax's turn markers (`]~b]`, `]~!b[`, `[e~[`), which no pattern above has the shape
# of. A lookahead, as above, so that overlapping ones (`]~b]~b]`) are each broken:
# `str.replace` skipped the second, and it reached the model whole.
_ODD_TOKEN = re.compile(r"\](?=~b\]|~!b\[)|\[(?=e~\[)")


def neutralize(text: str) -> str:
    """`text` with every control-token-shaped sequence broken up."""
    # Most text has no bracket at all: a substring test is far cheaper than two scans.
    if "<" in text:
        text = _ANGLE_TOKEN.sub("< ", text)
    if "[" in text:
        text = _SQUARE_TOKEN.sub("[ ", text)
    # `~` is common (URLs, "~5"): the regex scans only text that holds a marker, at about
    # the cost of the substring tests (the scan alone is about 6x that).
    if "~" in text and ("]~b]" in text or "]~!b[" in text or "[e~[" in text):
        text = _ODD_TOKEN.sub(r"\g<0> ", text)
    return text


def user_message(instruction: str, query: str, document: str) -> str:
    """The user turn, every caller-supplied part neutralized."""
    return (
        f"<Instruct>: {neutralize(instruction)}\n<Query>: {neutralize(query)}\n"
        f"<Document>: {neutralize(document)}"
    )


# Stand-ins for the caller's parts when a prompt's fixed text is digested.
SLOTS = ("\0instruction", "\0query", "\0document")


def digest(*parts: str) -> str:
    """A short digest of a scorer's fixed prompt text, for its `variant` (a part of every
    score-cache key): a release that rewords a prompt, or a change of settings that
    changes it, does not answer from scores the old wording earned."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode())
        hashed.update(b"\0")
    return "prompt " + hashed.hexdigest()[:16]


def qwen3_variant(assistant_prefill: bool) -> str:
    """The `chat` and `completion` scorers' variant: the Qwen3-Reranker prompt, with or
    without its prefill."""
    return digest(
        SYSTEM_PROMPT,
        user_message(*SLOTS),
        ASSISTANT_PREFILL if assistant_prefill else "no prefill",
    )
