"""Inbound security shared by both edges: bearer tokens and TLS certificate files.

Transport-specific wiring stays at each edge (`api/grpc_server.py` for gRPC, `http_api/`
for HTTP); what is here knows neither grpc nor HTTP frameworks. docs/security.md has the
threat model.
"""
