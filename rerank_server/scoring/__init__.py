"""Scoring: (query, document) pairs into relevance scores on 0..1, in three layers.

- Users of a scorer: `budget` (score within a request's time budget), `registry`
  (`--backend` to a scorer), `monitor` (health polls and the sanity probe).
- `backends/`: one scorer per model server API, and what they share.
- `transport/`: the client of one instance, the lean HTTP/1.1 transport, the pool of
  instances, the errors scorers see.
- The contract under all three: `base` (the `Scorer` protocol, `PairOutcome`, `Failure`)
  and `calls` (tasks that make their backend calls themselves).

Backends know nothing of the edge (no protobuf, no grpc request types), and reach
instances only through the pool (import contracts in pyproject.toml).
"""
