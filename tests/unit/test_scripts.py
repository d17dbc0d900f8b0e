"""The writing system of a request (`ranking/scripts.py`), which a blend profile that names
its model's scripts reads."""

from __future__ import annotations

import pytest

from rerank_server.ranking.scripts import dominant_script, reads


@pytest.mark.parametrize(
    ("query", "documents", "script"),
    [
        ("what do cats eat?", ["Cats eat meat."], "Latin"),
        ("café crème", ["naïve façade"], "Latin"),
        ("ما هي عاصمة فرنسا؟", ["باريس هي عاصمة فرنسا"], "Arabic"),
        ("Что едят кошки?", ["Кошки едят мясо."], "Cyrillic"),
        ("猫的食物", ["猫吃肉"], "Han"),
        ("12345", ["67 89"], "Latin"),  # all ASCII: nothing a Latin reader cannot read
        ("", [], "Latin"),
    ],
)
def test_the_script_most_letters_are_in(query: str, documents: list[str], script: str) -> None:
    assert dominant_script(query, documents) == script


def test_the_documents_count_beside_the_query() -> None:
    """An English query over Arabic documents: the model cannot read what it scores."""
    assert (
        dominant_script("capital of France", ["باريس هي عاصمة فرنسا وأكبر مدنها"] * 3) == "Arabic"
    )
    assert dominant_script("ما هي", ["The capital of France is Paris."] * 3) == "Latin"


def test_only_the_head_of_the_first_documents_is_read() -> None:
    """A fixed cost per request, however long its documents or how many."""
    long_tail = "x" * 256 + "ب" * 100_000
    assert dominant_script("q", [long_tail]) == "Latin"


def test_a_profile_without_scripts_reads_everything() -> None:
    assert reads((), "Arabic") and reads(("Latin",), "Latin") and reads(("Latin",), "")
    assert not reads(("Latin",), "Arabic")
