"""The rendezvous store a launch hosts, listening only on the interface of its host address."""
from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

from .ending import interrupts_deferred

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def bind_listener(host: str, port: int, listen: bool = True) -> socket.socket:
    """A socket bound to host:port (0 = a free port the OS picks), on that address only; listening if `listen`
    (bound alone it holds the port, and a connection to it is refused).

    TCPStore(host, port, is_master=True) listens on every interface whatever host says; given a socket bound here
    (master_listen_fd) it serves on this one: a loopback host keeps the store unreachable from other machines.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = None
    try:
        # Ctrl-C waits for the socket to exist and be named: raised inside socket.socket() it left the new
        # descriptor open, held by the traceback a notebook keeps (issue 61, N8)
        with interrupts_deferred() as pending:
            sock = socket.socket(family, socket.SOCK_STREAM)
        if pending:
            raise KeyboardInterrupt
        sock.bind(addr)
        if listen:
            sock.listen(128)
        return sock
    except BaseException:  # Ctrl-C too: no socket outlives the call
        if sock is not None:
            sock.close()
        raise


def serve_store(sock: socket.socket, host: str, world_size: int, timeout_s: float) -> TCPStore:
    """Start the store's server on the bound socket; the ranks join it as clients (see env.launched_env)."""
    import torch.distributed as dist  # here, not at import: launcher imports this module (see there)

    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on, and closes it when it ends (or fails)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
