"""A listening socket for the servers (`river serve`, `river rpc-server`): a taken port or an address this machine
does not have is one line before anything claims to be serving."""
from __future__ import annotations

import socket

from .format import RiverError


def listen(host: str, port: int):
    """The server's socket, bound and listening: a taken port or an unknown host is a RiverError here, before
    anything claims to be serving."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RiverError(f"cannot serve on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise RiverError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock
