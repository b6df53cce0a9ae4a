"""The contextd.v1 protobuf and gRPC modules, generated from proto/ when the package is built.

`context_service_pb2` (messages, with type stubs) and `context_service_pb2_grpc`
(`ContextServiceStub`) for callers that want the raw contract; `contextd_client.Client`
wraps them. They register the same descriptors as the server's `contextd.v1`, so both can
be imported in one process (see client/codegen.py).
"""
