"""Free TCP ports for test servers (bound once by the OS, then released)."""

import socket


def free_ports(n: int = 3) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
