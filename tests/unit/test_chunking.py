"""Best-chunk selection: whole short texts, query-matching windows, sentence bounds, rare terms."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rerank_server.ranking.chunking import best_chunk, query_term_weights, select_chunks


def test_short_text_passes_whole() -> None:
    assert select_chunks("q", ["short", "also short"], 100) == ["short", "also short"]


def test_window_contains_the_matching_sentence_on_boundaries() -> None:
    filler = "Filler sentence without anything. " * 30
    text = filler + "Volcanoes erupt when magma rises. " + filler
    chunk = select_chunks("why do volcanoes erupt", [text], 200)[0]
    assert "Volcanoes erupt when magma rises." in chunk
    assert len(chunk) <= 200
    assert chunk.endswith(".") and chunk[0].isupper()
    assert chunk in text


def test_rare_terms_outweigh_common_ones() -> None:
    """'the' is in every candidate; 'okapi' in one: the okapi sentence wins."""
    common = "The the the the the the the the. " * 5
    doc = common + "An okapi lives in the forest. " + common
    others = ["The cat.", "The dog.", "The bird."]
    weights = query_term_weights("the okapi", [doc, *others])
    assert weights["okapi"] > weights["the"]
    assert "okapi" in best_chunk(doc, 60, weights)


def test_no_match_takes_the_start() -> None:
    text = "First sentence here. " * 20
    assert best_chunk(text, 50, {"zebra": 1.0}) == text[:42].rstrip()


def test_sentence_longer_than_window_is_hard_wrapped() -> None:
    text = "word " * 200 + "target"
    chunk = best_chunk(text, 50, {"target": 1.0})
    assert "target" in chunk and len(chunk) <= 50


def test_deterministic() -> None:
    text = "Cats are nice. Dogs are loyal. " * 40
    weights = query_term_weights("dogs", [text])
    assert best_chunk(text, 80, weights) == best_chunk(text, 80, weights)


@given(st.text(min_size=0, max_size=800), st.text(max_size=40), st.integers(20, 300))
def test_chunk_is_a_bounded_substring(text: str, query: str, limit: int) -> None:
    chunk = select_chunks(query, [text], limit)[0]
    assert chunk in text
    assert len(chunk) <= limit
    if len(text) <= limit:
        assert chunk == text


def test_chinese_and_japanese_are_matched_by_their_characters() -> None:
    """No spaces between words: each run of characters was one "word", so a query never
    matched one, and the window was always the document's start."""
    filler_zh = "今天天气很好，我们去公园散步。" * 20
    relevant_zh = "火山爆发是因为岩浆上升到地表。"
    text = filler_zh + relevant_zh + filler_zh
    chunk = select_chunks("火山为什么会爆发", [text], 100)[0]
    assert relevant_zh in chunk and len(chunk) <= 100
    filler_ja = "今日はとても良い天気でした。" * 20
    relevant_ja = "猫は肉を食べる動物です。"
    chunk = select_chunks("猫は何を食べますか", [filler_ja + relevant_ja + filler_ja], 60)[0]
    assert relevant_ja in chunk
    # ... and a sentence ends at 。, so the window starts on a sentence
    assert chunk.startswith(("今日", "猫"))


def test_a_text_that_opens_with_spaces_is_not_scored_as_blank() -> None:
    """Only leading line breaks were skipped: a window's worth of spaces (or no-break
    spaces) made a blank first piece, the window taken when no query term matched."""
    for space in (" ", "\u00a0"):
        text = space * 120 + "Real text that says something. " * 10
        chunk = best_chunk(text, 100, {"zebra": 1.0})
        assert chunk.strip() and chunk.startswith("Real text")
