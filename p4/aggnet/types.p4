// Types shared by the aggnet controls.
#ifndef AGGNET_TYPES_P4
#define AGGNET_TYPES_P4

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<9> port_t;

// Why a packet was dropped: the indices of the `drops` counter, in the
// order of the aggregator host's counters (hosts/switch.py COUNTERS).
const bit<32> DROP_SHORT = 0;
const bit<32> DROP_MAGIC = 1;
const bit<32> DROP_VERSION = 2;
const bit<32> DROP_RESERVED = 3;
const bit<32> DROP_DTYPE = 4;
const bit<32> DROP_LENGTH = 5;
const bit<32> DROP_UNKNOWN_JOB = 6;
const bit<32> DROP_NOT_ADMITTED = 7;
const bit<32> DROP_INDEX = 8;
const bit<32> DROP_STALE = 9;
const bit<32> DROP_DUPLICATE = 10;
const bit<32> DROP_EARLY = 11;
const bit<32> DROP_EXPONENT = 12;
const bit<32> DROP_FINAL = 13;
const bit<32> DROP_TYPE = 14;

// What happened: the indices of the `events` counter.
const bit<32> EV_RECEIVED = 0;
const bit<32> EV_SUMMED = 1;
const bit<32> EV_COMPLETED = 2;
const bit<32> EV_RESULTS_RESENT = 3;
const bit<32> EV_UPLINK_SENT = 4;
const bit<32> EV_UPLINK_RESENT = 5;
const bit<32> EV_FINALS = 6;
const bit<32> EV_PROBES = 7;
const bit<32> EV_JOINS = 8;

struct metadata_t {
    // from the jobs table
    bit<8> job_row;
    bit<32> base;
    bit<32> slots;
    bit<8> world;
    bit<16> group;
    bit<16> rid_base;
    bit<1> uplink;
    bit<16> rack_id;
    ipv4_addr_t parent_ip;
    mac_addr_t parent_mac;
    port_t parent_port;
    ipv4_addr_t switch_ip;
    mac_addr_t switch_mac;
    // register indices of this slot's version and of the other version
    bit<32> idx;
    bit<32> other_idx;
}

#endif
