"""A worker's side: one client per aggregator kind behind one base (base:
the all-reduce API and its request machinery; chunked: the sharded
service; switch: the switch protocol; sparse: row tables), the codecs,
the chunk plan, the embedded local aggregator and per-host groups."""
