"""The rendezvous store a launch hosts, listening only on the interface of its host address."""
from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0 = a free port the OS picks), on that address only.

    TCPStore(host, port, is_master=True) listens on every interface whatever host says; given a socket bound here
    (master_listen_fd) it serves on this one: a loopback host keeps the store unreachable from other machines.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(sock: socket.socket, host: str, world_size: int, timeout_s: float) -> TCPStore:
    """Start the store's server on the bound socket; the ranks join it as clients (see env.launched_env)."""
    import torch.distributed as dist  # here, not at import: launcher imports this module (see there)

    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    sock.detach()  # the store owns the descriptor now, and closes it when it ends
    return store
