// Egress: each replica of a result is addressed to its worker (MAC and IP
// from the control plane, UDP port learned from the worker's packets);
// flooded broadcasts do not go back out of the port they came in on.
#ifndef AGGNET_EGRESS_P4
#define AGGNET_EGRESS_P4

control AggEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    action to_member(mac_addr_t mac, ipv4_addr_t ip) {
        hdr.eth.dst = mac;
        hdr.ipv4.dst = ip;
        bit<16> port;
        member_port.read(port, (bit<32>)sm.egress_rid);
        hdr.udp.dst_port = port;
    }
    table replicas {
        key = { sm.egress_rid: exact; }
        actions = { to_member; NoAction; }
        default_action = NoAction();
        size = AGG_MAX_REPLICAS;
    }
    apply {
        if (sm.egress_rid != 0) {
            replicas.apply();
        } else if (sm.mcast_grp == FLOOD_GROUP && sm.egress_port == sm.ingress_port) {
            mark_to_drop(sm);
        }
    }
}

#endif
