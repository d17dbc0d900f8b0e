"""What both edges share: bearer tokens and their limits, TLS certificate files, the
request byte budget and the clients' timeouts. Nothing here knows grpc or HTTP frameworks
(docs/security.md).
"""
