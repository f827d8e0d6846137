// The aggregation rules of docs/protocol.md on the slot pool's registers.
// Every branch mirrors hosts/switch_datapath.py:process_batch, which is the
// reference this control is tested against packet for packet.
#ifndef AGGNET_AGGREGATE_P4
#define AGGNET_AGGREGATE_P4

// UDP port of every job member, learned from its JOIN: its PUSH and PROBE
// must come from it, and the egress reads it when it rewrites a result
// replica to that member.
register<bit<16>>(AGG_MAX_REPLICAS) member_port;

control Aggregate(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(AGG_DROP_REASONS, CounterType.packets) drops;
    counter(AGG_EVENTS, CounterType.packets) events;
    counter(AGG_MAX_JOBS, CounterType.packets) completions;

    // per slot and version
    register<bit<32>>(AGG_REGISTERS) tag;
    register<bit<8>>(AGG_REGISTERS) count;
    register<bit<32>>(AGG_REGISTERS) seen;
    register<bit<16>>(AGG_REGISTERS) exponent;
    register<bit<16>>(AGG_REGISTERS) max_exponent;

#include "values.p4"
#include "messages.p4"

    action drop_for(bit<32> reason) {
        drops.count(reason);
        mark_to_drop(sm);
    }

    action job(bit<8> row, bit<32> base, bit<32> slots, bit<8> world, bit<16> group, bit<16> rid_base,
               bit<1> uplink, bit<16> rack_id, ipv4_addr_t parent_ip, mac_addr_t parent_mac, port_t parent_port,
               ipv4_addr_t switch_ip, mac_addr_t switch_mac) {
        meta.job_row = row;
        meta.base = base;
        meta.slots = slots;
        meta.world = world;
        meta.group = group;
        meta.rid_base = rid_base;
        meta.uplink = uplink;
        meta.rack_id = rack_id;
        meta.parent_ip = parent_ip;
        meta.parent_mac = parent_mac;
        meta.parent_port = parent_port;
        meta.switch_ip = switch_ip;
        meta.switch_mac = switch_mac;
    }
    // the installed jobs: slice of the pool, world, multicast group, uplink
    table jobs {
        key = { hdr.agg.job_id: exact; }
        actions = { job; NoAction; }
        default_action = NoAction();
        size = AGG_MAX_JOBS;
    }

    action admit() { }
    // who may contribute to which job, as which worker bit (the sender)
    table admission {
        key = {
            hdr.agg.job_id: exact;
            hdr.agg.sender: exact;
            hdr.ipv4.src: exact;
        }
        actions = { admit; NoAction; }
        default_action = NoAction();
        size = AGG_MAX_MEMBERS;
    }

    // -- where a rewritten packet goes ---------------------------------------------

    action back_to_sender() {
        mac_addr_t m = hdr.eth.dst;
        hdr.eth.dst = hdr.eth.src;
        hdr.eth.src = m;
        ipv4_addr_t a = hdr.ipv4.dst;
        hdr.ipv4.dst = hdr.ipv4.src;
        hdr.ipv4.src = a;
        bit<16> p = hdr.udp.dst_port;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = p;
        hdr.udp.checksum = 0;
        sm.egress_spec = sm.ingress_port;
    }

    action to_every_worker() {
        hdr.eth.src = meta.switch_mac;
        hdr.ipv4.src = meta.switch_ip;
        hdr.udp.src_port = AGG_UDP_PORT;
        hdr.udp.checksum = 0;
        sm.mcast_grp = meta.group;
    }

    action to_parent() {
        hdr.eth.src = meta.switch_mac;
        hdr.eth.dst = meta.parent_mac;
        hdr.ipv4.src = meta.switch_ip;
        hdr.ipv4.dst = meta.parent_ip;
        hdr.udp.src_port = AGG_UDP_PORT;
        hdr.udp.dst_port = AGG_UDP_PORT;
        hdr.udp.checksum = 0;
        sm.egress_spec = meta.parent_port;
    }

    // -- what a rewritten packet says ------------------------------------------------

    action as_result(bit<16> max_exp) {
        hdr.agg.msg_type = msg_type_t.RESULT;
        hdr.agg.flags = hdr.agg.flags & (FLAG_VERSION | FLAG_UPLINK);
        hdr.agg.sender = 0;
        hdr.agg.next_exponent = max_exp;
        hdr.agg.nsum = (bit<16>)meta.world;
        hdr.agg.world = (bit<16>)meta.world;
    }

    action as_partial(bit<16> max_exp) {
        hdr.agg.msg_type = msg_type_t.PUSH;
        hdr.agg.flags = (hdr.agg.flags & FLAG_VERSION) | FLAG_UPLINK;
        hdr.agg.sender = meta.rack_id;
        hdr.agg.next_exponent = max_exp;
        hdr.agg.nsum = (bit<16>)meta.world;
        hdr.agg.world = (bit<16>)meta.world;
    }

    apply {
        events.count(EV_RECEIVED);
        if (!hdr.agg.isValid()) {
            drop_for(DROP_SHORT);  // a datagram to the port too short for the header
            return;
        }
        if (hdr.agg.magic != AGG_MAGIC) {
            drop_for(DROP_MAGIC);
            return;
        }
        if (hdr.agg.version != AGG_VERSION) {
            drop_for(DROP_VERSION);
            return;
        }
        if (hdr.agg.msg_type != msg_type_t.PUSH && hdr.agg.msg_type != msg_type_t.RESULT &&
                hdr.agg.msg_type != msg_type_t.PROBE && hdr.agg.msg_type != msg_type_t.JOIN) {
            drop_for(DROP_TYPE);  // control messages are the control plane's
            return;
        }
        if (hdr.agg.reserved != 0) {
            drop_for(DROP_RESERVED);
            return;
        }
        if (!jobs.apply().hit) {
            drop_for(DROP_UNKNOWN_JOB);
            return;
        }
        // looked up once: a table applies at most once on any path
        bool admitted = admission.apply().hit;
        if (hdr.agg.msg_type == msg_type_t.JOIN) {
            // an installed member learns its slice, K and world here
            if (!admitted) {
                drop_for(DROP_NOT_ADMITTED);
                return;
            }
            member_port.write((bit<32>)meta.rid_base + (bit<32>)hdr.agg.sender, hdr.udp.src_port);
            // shard slots: the JOIN's ref goes back as it came (0 from a worker)
            answer_join_ok(meta.slots, (bit<16>)AGG_ELEMENTS, (bit<64>)meta.base, (bit<16>)meta.world,
                           hdr.agg.ref);
            back_to_sender();
            events.count(EV_JOINS);
            return;
        }
        if (hdr.agg.index >= meta.slots) {
            drop_for(DROP_INDEX);
            return;
        }
        bit<32> version_base = (hdr.agg.flags & FLAG_VERSION) == 0 ? 32w0 : AGG_POOL;
        bit<32> other_base = (hdr.agg.flags & FLAG_VERSION) == 0 ? AGG_POOL : 32w0;
        meta.idx = version_base + meta.base + hdr.agg.index;
        meta.other_idx = other_base + meta.base + hdr.agg.index;

        bit<8> c;
        bit<32> s;
        bit<32> stored_tag;
        count.read(c, meta.idx);
        seen.read(s, meta.idx);
        tag.read(stored_tag, meta.idx);

        // a PUSH or a PROBE comes from an installed member's address, at the
        // UDP port it joined from (an address alone admits any process there)
        bit<16> joined_port = 0;
        if (hdr.agg.sender < (bit<16>)meta.world) {
            member_port.read(joined_port, (bit<32>)meta.rid_base + (bit<32>)hdr.agg.sender);
        }
        bool member = admitted && hdr.agg.sender < (bit<16>)meta.world && joined_port == hdr.udp.src_port;

        if (hdr.agg.msg_type == msg_type_t.PROBE) {
            // answered to members only: a slot's state is the job's, and an
            // answer to anyone would reflect spoofed sources
            if (!member) {
                drop_for(DROP_NOT_ADMITTED);
                return;
            }
            if (hdr.udp.length != 8 + AGG_HEADER_BYTES) {
                drop_for(DROP_LENGTH);
                return;
            }
            answer_probe_ok((bit<16>)c, s, (bit<64>)stored_tag, (bit<16>)meta.world);
            back_to_sender();
            events.count(EV_PROBES);
            return;
        }
        if (hdr.agg.dtype != DTYPE_INT32) {
            drop_for(DROP_DTYPE);
            return;
        }
        if (!hdr.payload.isValid() || hdr.udp.length != 8 + AGG_HEADER_BYTES + AGG_PAYLOAD_BYTES) {
            drop_for(DROP_LENGTH);
            return;
        }

        if (hdr.agg.msg_type == msg_type_t.RESULT) {
            // only the parent's final sum, at a rack waiting on it
            if ((hdr.agg.flags & FLAG_UPLINK) == 0 || meta.uplink == 0 || hdr.ipv4.src != meta.parent_ip) {
                drop_for(DROP_NOT_ADMITTED);
                return;
            }
            if (stored_tag != hdr.agg.ref || c != meta.world) {
                drop_for(DROP_FINAL);
                return;
            }
            values_store(meta.idx);
            count.write(meta.idx, 0);
            max_exponent.write(meta.idx, hdr.agg.next_exponent);
            hdr.agg.flags = hdr.agg.flags & FLAG_VERSION;
            hdr.agg.sender = 0;
            hdr.agg.world = (bit<16>)meta.world;
            to_every_worker();
            events.count(EV_FINALS);
            return;
        }

        // a PUSH
        if (!member) {
            drop_for(DROP_NOT_ADMITTED);
            return;
        }
        bit<32> bit_mask = 32w1 << (bit<8>)hdr.agg.sender;
        bit<32> d = hdr.agg.ref - stored_tag;
        bit<16> max_exp;
        max_exponent.read(max_exp, meta.idx);

        if (d[31:31] == 1) {
            drop_for(DROP_STALE);  // older than the slot's block: a late duplicate
            return;
        }
        if (d == 0 && (s & bit_mask) != 0) {
            if (c == 0) {
                // complete: the sender lost the result; answer it alone
                values_read(meta.idx);
                as_result(max_exp);
                back_to_sender();
                events.count(EV_RESULTS_RESENT);
            } else if (meta.uplink == 1 && c == meta.world && hdr.agg.sender == UPLINK_RESENDER) {
                // waiting on the parent: the partial (or the final) was lost;
                // one member's retransmission asks for the one resend up, the
                // other members' are duplicates
                values_read(meta.idx);
                as_partial(max_exp);
                to_parent();
                events.count(EV_UPLINK_RESENT);
            } else {
                drop_for(DROP_DUPLICATE);
            }
            return;
        }
        if (d != 0) {
            if (c != 0) {
                drop_for(DROP_EARLY);
                return;
            }
            // first contribution: overwrite
            values_overwrite(meta.idx);
            c = 1;
            tag.write(meta.idx, hdr.agg.ref);
            seen.write(meta.idx, bit_mask);
            exponent.write(meta.idx, hdr.agg.exponent);
            max_exp = hdr.agg.next_exponent;
            max_exponent.write(meta.idx, max_exp);
        } else {
            if (c == 0) {
                drop_for(DROP_STALE);
                return;
            }
            bit<16> e;
            exponent.read(e, meta.idx);
            if (e != hdr.agg.exponent) {
                drop_for(DROP_EXPONENT);
                return;
            }
            // later contribution: add; the payload now carries the sum
            values_add(meta.idx);
            c = c + 1;
            seen.write(meta.idx, s | bit_mask);
            if ((int<16>)hdr.agg.next_exponent > (int<16>)max_exp) {
                max_exp = hdr.agg.next_exponent;
                max_exponent.write(meta.idx, max_exp);
            }
        }
        // the sender moved on from the other version
        bit<32> other_seen;
        seen.read(other_seen, meta.other_idx);
        seen.write(meta.other_idx, other_seen & ~bit_mask);
        events.count(EV_SUMMED);

        if (c != meta.world) {
            count.write(meta.idx, c);
            mark_to_drop(sm);  // summed; the result comes with the last contribution
            return;
        }
        if (meta.uplink == 1) {
            count.write(meta.idx, c);  // complete here: waiting on the parent
            as_partial(max_exp);
            to_parent();
            events.count(EV_UPLINK_SENT);
        } else {
            count.write(meta.idx, 0);
            as_result(max_exp);
            to_every_worker();
            events.count(EV_COMPLETED);
            completions.count((bit<32>)meta.job_row);
        }
    }
}

#endif
