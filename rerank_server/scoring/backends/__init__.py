"""The scoring backends: one scorer per model server API (`--backend`), and what they share.

Each turns pairs into scores on 0..1, calling through a `transport.pool.BackendPool`.
"""
