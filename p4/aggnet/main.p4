// aggnet: in-network aggregation of int32 vectors (docs/protocol.md) on
// BMv2's v1model. This file only composes the pieces.
#include <core.p4>
#include <v1model.p4>

#include "configuration.p4"
#include "types.p4"
#include "headers.p4"
#include "parser.p4"
#include "checksums.p4"
#include "forward.p4"
#include "aggregate.p4"
#include "egress.p4"

control AggIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    Aggregate() aggregate;
    Forward() forward;
    apply {
        if (hdr.udp.isValid() && hdr.udp.dst_port == AGG_UDP_PORT) {
            aggregate.apply(hdr, meta, sm);
        } else {
            forward.apply(hdr, meta, sm);
        }
    }
}

V1Switch(AggParser(), AggVerifyChecksum(), AggIngress(), AggEgress(), AggComputeChecksum(), AggDeparser()) main;
