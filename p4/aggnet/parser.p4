// Parser and deparser: Ethernet / IPv4 / UDP to port AGG_UDP_PORT / aggnet
// header / payload (only for PUSH and RESULT carrying AGG_ELEMENTS values).
#ifndef AGGNET_PARSER_P4
#define AGGNET_PARSER_P4

parser AggParser(packet_in pkt, out headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol, hdr.ipv4.ihl, hdr.ipv4.frag_offset) {
            (IPPROTO_UDP, 5, 0): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            AGG_UDP_PORT: parse_agg;
            default: accept;
        }
    }
    state parse_agg {
        // a truncated header ends parsing with PacketTooShort: ingress
        // drops it as "short"
        pkt.extract(hdr.agg);
        transition select(hdr.agg.msg_type, hdr.agg.count) {
            (msg_type_t.PUSH, AGG_ELEMENTS): parse_payload;
            (msg_type_t.RESULT, AGG_ELEMENTS): parse_payload;
            default: accept;
        }
    }
    state parse_payload {
        pkt.extract(hdr.payload);
        transition accept;
    }
}

control AggDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.eth);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.agg);
        pkt.emit(hdr.payload);
    }
}

#endif
