"""`rerank-server eval`: ranking quality on a BEIR-layout data set (docs/benchmarks.md).

BM25 (bm25s) retrieves candidates, a rerank-server reranks them once per blend strategy,
and ranx computes the metrics and the paired significance tests. Needs the `eval` extra.
"""
