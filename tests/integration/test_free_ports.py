"""Ports a parent picks for a child to bind seconds later (a rendezvous
of spawned workers): outside the range outgoing connections draw from."""

import socket

from aggnet.processes import _ephemeral_start, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    top = _ephemeral_start()
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        ports = free_ports(8, kind)
        assert len(set(ports)) == 8
        assert all(p < top for p in ports), (ports, top)
        for p in ports:
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind(("127.0.0.1", p))


def test_a_held_port_is_never_handed_out():
    held = []
    try:
        for port in free_ports(16):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(20):
            assert not taken & set(free_ports(4))
    finally:
        for s in held:
            s.close()


def test_outgoing_connections_do_not_take_the_ports_handed_out():
    # the race this avoids: connections made while a spawned worker starts
    # take their local ports from the ephemeral range
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = []
        try:
            for _ in range(32):
                c = socket.create_connection(server.getsockname())
                clients.append(c)
            local = {c.getsockname()[1] for c in clients}
            assert all(p >= _ephemeral_start() for p in local)
            assert not local & set(free_ports(8))
        finally:
            for c in clients:
                c.close()


def test_a_seeded_random_module_does_not_repeat_the_draw():
    # hypothesis seeds `random` per example: two pytest workers seeded alike
    # must still draw different ports
    import random

    random.seed(1)
    first = free_ports(4)
    random.seed(1)
    assert free_ports(4) != first
