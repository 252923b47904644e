"""The KServe v2 protocol, neutral to transport and runtime: the codec (``kserve``), what a
server serves (``models``), Triton's extensions answered from it (``surface``) and the model
configuration rendered through Triton's own protobuf (``pbtxt``). ``http`` and ``grpc``
both build on it; it imports no server and no runtime."""
