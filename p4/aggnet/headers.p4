// Packet headers: L2-L4, and the aggnet header generated from aggnet/wire.py.
#ifndef AGGNET_HEADERS_P4
#define AGGNET_HEADERS_P4

#include "wire.p4"

header ethernet_h {
    mac_addr_t dst;
    mac_addr_t src;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    ipv4_addr_t src;
    ipv4_addr_t dst;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

struct headers_t {
    ethernet_h eth;
    ipv4_h ipv4;
    udp_h udp;
    aggnet_h agg;
    payload_h payload;
}

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IPPROTO_UDP = 17;

#endif
