"""rerank-server: an asynchronous gRPC reranking service in front of a model server."""

__version__ = "0.1.0"
