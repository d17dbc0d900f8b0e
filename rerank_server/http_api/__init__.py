"""The HTTP edge: the ecosystem's JSON rerank API over the same pipeline as gRPC.

`POST /v1/rerank` and `/v2/rerank` in the Cohere/Jina shape (the official Cohere SDK works
against them unmodified), `POST /rerank` in TEI's shape, `GET /health`, `GET /v1/models`,
and the OpenAPI document FastAPI generates from `models.py` (`/openapi.json`, `/docs`).
Served by uvicorn in the same process and event loop as gRPC (`server.py`). Like the gRPC
edge, it converts wire types to domain types and back and knows nothing below the
pipeline. docs/http.md.
"""
