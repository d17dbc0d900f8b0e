"""`rerank-server bench`: speed, measured side by side in one run (docs/benchmarks.md)."""
