"""The HTTP edge: the ecosystem's JSON rerank API over the same pipeline as gRPC.

Cohere/Jina and TEI shapes, served by uvicorn in the gRPC server's loop (docs/http.md).
"""
