"""Wire code that kvsvc's clients and its server both speak, owned by neither side.

A codec the client encodes and the server decodes (or the other way round) has one
definition here, so the two ends cannot drift apart and neither imports the other's
internals. Modules here import only :mod:`kvsvc.v1` (the generated messages), protobuf and
the standard library:

- :mod:`kvsvc.wire.frames`: the framed transport's framing (``protos/kvsvc/v1/frames.proto``);
- :mod:`kvsvc.wire.packed`: packed repeated-varint columns written as bytes.
"""
