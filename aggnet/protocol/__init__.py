"""What every party agrees on, and nothing else: the header and its enums
(wire), every bound, counter and drop reason (limits), the header fields
replies reuse (messages), the slot pool's allocator (pool), control
payloads (control), addresses (address), job keys (keys), the sparse tables' row
layout (sparse_layout), topology files (topology) and a capture dissector
(pcap). Imports nothing of aggnet's outside this package."""
