"""The cluster-wide prefix index: which engines hold which cached blocks, kept in Redis.

DESIGN ("Past one machine: the cluster index"): one kvsvc per engine, an indexer that
follows every engine's event stream into Redis (:mod:`kvsvc.cluster.indexer`, with the
key layout of :mod:`kvsvc.cluster.layout`), and a scorer that tells a router, per
engine, how many leading tokens of a prompt that engine has cached
(:mod:`kvsvc.cluster.score`, served by :mod:`kvsvc.cluster.router`).

This package's root and :mod:`kvsvc.cluster.hashing` import neither redis nor grpc. The
hash seed's file and fingerprint, which the servers read too, are the core's
(:mod:`kvsvc.core.seed`): the cluster sits above the server and the core, never below.
"""
