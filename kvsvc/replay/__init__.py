"""``kvsvc replay``: a request trace replayed through real kvsvc servers, the cluster
index and its router, next to the bounds kvsvc's own core computes.

A capacity-planning tool as much as a benchmark: for a user's own traffic (a JSONL trace
in Mooncake's format) it shows what routing and memory buy, per routing policy and fleet
size, before anything is deployed.

- :mod:`~kvsvc.replay.trace`: the trace format, read and checked; a trace block's tokens.
- :mod:`~kvsvc.replay.engine`: the service model and the simulated engine that drives one
  real pool with Allocate, Step and Free.
- :mod:`~kvsvc.replay.fleet`: the processes: a redis-server (unless given one), one
  ``kvsvc serve`` per engine, ``kvsvc indexer`` and ``kvsvc router``.
- :mod:`~kvsvc.replay.bounds`: an infinite cache and one cache of the whole memory,
  computed in process with :class:`kvsvc.core.PoolKVCache`.
- :mod:`~kvsvc.replay.run`: the replay's clock and the routing policies.
- :mod:`~kvsvc.replay.report`: the table, the JSON object and the plot.
"""
