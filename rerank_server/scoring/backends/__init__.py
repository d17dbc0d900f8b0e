"""The scoring backends: each turns (query, document) pairs into scores on 0..1 through
one kind of model server API, calling through a `transport.pool.BackendPool`.

`chat`, `completion`, `rerank_api`, `embedding`, `ollama` and `llm` are the scorers
(`--backend`); `prompt` and `logprobs` are what the yes/no ones share, `context_fit`
cuts documents to the model's context, `batching` fans a request's pairs out, and
`pooled_scorer` is every scorer's base.
"""
