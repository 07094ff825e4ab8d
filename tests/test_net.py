"""mcore_rl/net.py: the one free-port helper."""

import socket

from mcore_rl.net import free_port


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
