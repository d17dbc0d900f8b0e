"""`rerank-server eval` and `fit`: ranking quality on BEIR-layout data sets, and blend
profiles fitted on it (docs/benchmarks.md, docs/blending.md). Needs the `eval` extra.
"""
