"""Scoring: (query, document) pairs into relevance scores on 0..1, in layers.

`budget`, `registry`, `monitor` → `backends/` → `transport/` → `base`, `calls`.
"""
