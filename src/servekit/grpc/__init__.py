"""KServe v2 over gRPC: Triton's ``GRPCInferenceService`` over servekit's models."""

from .service import GrpcService, grpc_server

__all__ = ["GrpcService", "grpc_server"]
