"""Managed mode: the assets (a llama-server built from the pinned source, the stand-in and
MiniLM models) in the cache, and the supervised llama-server child process."""
