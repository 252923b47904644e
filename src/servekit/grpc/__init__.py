"""KServe v2 over gRPC: Triton's ``GRPCInferenceService`` over servekit's models."""

from .service import GrpcOnLoop, GrpcService, grpc_server

__all__ = ["GrpcOnLoop", "GrpcService", "grpc_server"]
