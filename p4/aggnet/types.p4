// Types shared by the aggnet controls.
#ifndef AGGNET_TYPES_P4
#define AGGNET_TYPES_P4

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<9> port_t;

// Drop reasons and events (the counters' indices) are generated into
// limits.p4 from aggnet/protocol/limits.py.

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
