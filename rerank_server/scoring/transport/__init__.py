"""How scorers reach backends: HTTP to one instance, and the pool of instances.

`backend.HttpBackend` is the client of one instance (bounded calls, abandoned calls on a
leash, the side client for health and metadata), over `lean.LeanTransport` for plain
HTTP or httpx's own for the rest. `pool.BackendPool` balances across instances, ejects
outliers and retries elsewhere. `errors` holds the failures scorers see, `calls` the
tasks that make their calls themselves.
"""
