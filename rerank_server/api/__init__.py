"""The gRPC edge: the only package that knows protobuf and grpc request types.

It turns wire messages into domain values (`convert`), runs them through the ranking core
(`service`), and turns the answers back. Per-RPC log context, load shedding and RPC metrics
live in `interceptors`; `healthcheck` is the container health-check command. Nothing below
this package imports it.
"""
