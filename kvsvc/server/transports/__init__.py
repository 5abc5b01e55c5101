"""The server's two transports: one set of servicers, reached over gRPC or over frames.

The framed transport is a second way to reach the same servicers, not a second API: the
same request and response messages, handlers, auth, errors and metrics. What differs is
only how a call arrives (docs/architecture.md, "Two transports", says when to use which):

- :mod:`~kvsvc.server.transports.grpc_listener`: the gRPC listener (server, options,
  auth interceptor, services registered, ports and Unix sockets bound), every handler
  behind :mod:`~kvsvc.server.transports.gate` (malformed bodies, calls in flight), with
  health and :mod:`~kvsvc.server.transports.reflection`;
- :mod:`~kvsvc.server.transports.frames_listener`: the framed listener (the unary
  methods as length-prefixed frames, :mod:`kvsvc.wire.frames`);
- :mod:`~kvsvc.server.transports.auth`, below both: who may call what (credentials,
  roles per method, the one decision both listeners take) and the refusals' lines on the
  security log.

:mod:`kvsvc.server.app` composes pools, servicers, health and metrics and starts the
listeners through this package; the client side of the framed transport is
:mod:`kvsvc_client._frames`.
"""
