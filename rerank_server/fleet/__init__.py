"""What replicas of rerank-server behind one address share, in a Redis or Valkey
(`--cache-url`): the scores one of them computed for the others (`shared_cache.py`) and
the per-token limits counted for all (`limit_counter.py`), each through its own client
and circuit breaker (`redis_client.py`) and its own background writer (`writes.py`).

Assembled by `server.py`; the core sees only the `SharedTier` and `LimitCounter`
protocols. The shared store is an aid, never a cause of failure: a request waits for it
at most `--cache-timeout-ms`, and a store that fails is left alone until a probe finds it.
"""
