"""A model file's identity in the score cache's keys (`managed/identity.py`): its sha256,
from the hub cache's blob name or hashed once and remembered; two pipelines serving
files of one name but different contents share no cached score."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rerank_server.domain import Candidate, RerankQuery
from rerank_server.managed.identity import model_identity
from rerank_server.ranking.pipeline import Reranker
from rerank_server.ranking.score_cache import ScoreCache
from rerank_server.server import request_rules
from rerank_server.settings import Settings
from tests.fakes.scorer import FunctionScorer


def test_a_hub_blob_is_known_by_its_name_and_a_file_is_hashed_once(tmp_path: Path) -> None:
    digest = "ab" * 32
    blob = tmp_path / "hub" / "blobs" / digest
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"not hashed")
    link = tmp_path / "hub" / "model.gguf"
    link.symlink_to(blob)
    assert model_identity(link, tmp_path) == f"sha256:{digest}"

    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights v1")
    first = model_identity(model, tmp_path)
    assert first == f"sha256:{hashlib.sha256(b'weights v1').hexdigest()}"
    assert (tmp_path / "model-digests.json").exists()
    model.write_bytes(b"weights v2")  # a new file under the same name
    os.utime(model, ns=(1, 1))
    assert model_identity(model, tmp_path) == f"sha256:{hashlib.sha256(b'weights v2').hexdigest()}"


async def test_files_of_one_name_but_different_contents_share_no_score() -> None:
    cache = ScoreCache(1000, 3600)
    rules = request_rules(Settings())
    query = RerankQuery(
        request_id="r",
        query="q",
        candidates=tuple(Candidate(f"d{i}", f"doc {i}", i, i + 1) for i in range(3)),
    )
    old, new, same = FunctionScorer(), FunctionScorer(), FunctionScorer()
    await Reranker(rules, old, cache=cache, name="en", identity="sha256:aa").answer(query)
    await Reranker(rules, new, cache=cache, name="en", identity="sha256:bb").answer(query)
    await Reranker(rules, same, cache=cache, name="en", identity="sha256:aa").answer(query)
    assert len(old.seen) == len(new.seen) == 3 and same.seen == []
