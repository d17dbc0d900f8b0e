"""What replicas of rerank-server behind one address share: a Redis or Valkey
(`--cache-url`) holding the scores one of them computed for the others
(`shared_cache.py`), reached through one client and a circuit breaker
(`redis_client.py`).

Assembled by `server.py`; the ranking core sees only its `SharedTier` protocol. The
shared store is an aid, never a cause of failure: a request waits for it at most
`--cache-timeout-ms`, and a store that fails is left alone until a probe finds it back.
"""
