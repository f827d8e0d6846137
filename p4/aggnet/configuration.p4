// Sizes of the aggnet switch program, each with the reason for it. The
// bounds it shares with the hosts come from limits.p4, generated from
// aggnet/protocol/limits.py (the reasons for them are there).
#ifndef AGGNET_CONFIGURATION_P4
#define AGGNET_CONFIGURATION_P4

#include "limits.p4"

// Two versions per slot: the one being summed and the shadow of the last
// result (docs/protocol.md, "Why two versions").
const bit<32> AGG_REGISTERS = 2 * AGG_POOL;
// Admission entries: a worker bit per job row and worker.
const bit<32> AGG_MAX_MEMBERS = AGG_MAX_JOBS * (bit<32>)AGG_MAX_WORKERS;
// Replica ids: one per (job row, worker bit), plus 0 for "not a replica".
const bit<32> AGG_MAX_REPLICAS = AGG_MAX_MEMBERS + 1;

#endif
