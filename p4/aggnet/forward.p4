// Ordinary forwarding for everything that is not aggregation traffic:
// destination MAC to port, installed by the control plane; broadcast and
// unknown destinations flood (the egress prunes the ingress port).
#ifndef AGGNET_FORWARD_P4
#define AGGNET_FORWARD_P4

control Forward(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    action to_port(port_t port) {
        sm.egress_spec = port;
    }
    action flood() {
        sm.mcast_grp = FLOOD_GROUP;
    }
    table l2 {
        key = { hdr.eth.dst: exact; }
        actions = { to_port; flood; }
        default_action = flood();
        size = 1024;
    }
    apply {
        l2.apply();
    }
}

#endif
