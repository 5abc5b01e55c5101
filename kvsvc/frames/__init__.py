"""The framed transport: kvsvc's unary calls over a plain stream socket, without gRPC.

An engine on the same host as its server (a sidecar) pays gRPC's per-call machinery on
every Allocate and Step, several hundred microseconds on a busy core, more than the
server's own work for most calls. The framed transport carries the same request and
response messages, served by the same servicers with the same auth, as length-prefixed
frames on a Unix socket (or TCP, with TLS where the server has a certificate). Its wire
contract is ``protos/kvsvc/v1/frames.proto``; :mod:`kvsvc.frames.server` serves it and
:mod:`kvsvc.frames.channel` is the client side, a drop-in ``grpc.Channel`` for the
generated stubs.
"""
