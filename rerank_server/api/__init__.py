"""The gRPC edge: the only package that knows protobuf and grpc request types.

Wire messages become domain values (`convert`), run through the core (`service`) and back.
"""
