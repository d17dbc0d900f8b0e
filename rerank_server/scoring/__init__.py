"""Scoring backends: turn (query, document) pairs into relevance scores on 0..1.

The `Scorer` protocol (`base`), the HTTP client of one backend instance (`http`), the pool
of instances with balancing and ejection (`backend_pool`), what every scorer shares
(`pooled_scorer`), the prompt and its control-token neutralization (`prompt`), one module
per backend kind, the budgeted scoring loop (`budget`), and the backend monitor
(`monitor`). Backends know nothing of the edge: no protobuf, no grpc request types.
"""
