// IPv4 header checksum: recomputed for every packet the program rewrote.
// UDP checksums of aggregation packets are set to 0 (optional over IPv4).
#ifndef AGGNET_CHECKSUMS_P4
#define AGGNET_CHECKSUMS_P4

control AggVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control AggComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len, hdr.ipv4.identification,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol, hdr.ipv4.src, hdr.ipv4.dst },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

#endif
