// Sizes of the aggnet switch program, each with the reason for it.
#ifndef AGGNET_CONFIGURATION_P4
#define AGGNET_CONFIGURATION_P4

// Slots in the pool. A job's window is its slice of it; 1024 slots of 64
// elements hold 256 KiB of sums per version, enough for a few jobs' windows
// at the round trips of a rack (SwitchML used pools of 128-512 slots).
const bit<32> AGG_POOL = 1024;
// Two versions per slot: the one being summed and the shadow of the last
// result (docs/protocol.md, "Why two versions").
const bit<32> AGG_REGISTERS = 2 * AGG_POOL;
// Jobs installed at once: rows of the jobs table and of the multicast
// groups; 64 covers a rack's tenants.
const bit<32> AGG_MAX_JOBS = 64;
// Replica ids: one per (job row, worker bit), plus 0 for "not a replica".
const bit<32> AGG_MAX_REPLICAS = AGG_MAX_JOBS * 32 + 1;
// Multicast group that floods ordinary broadcast traffic (ARP) to every
// port; aggregation groups are job row + 1.
const bit<16> FLOOD_GROUP = 1000;
// Drop reasons and events counted by the data plane.
const bit<32> AGG_DROP_REASONS = 16;
const bit<32> AGG_EVENTS = 16;

#endif
