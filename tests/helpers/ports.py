"""`free_ports`: ports on 127.0.0.1 for a daemon a test starts, below the kernel's ephemeral range.

A port taken with bind(0) comes from the ephemeral range, and once it is let go any outgoing
connection (another test worker's, say) can be given it before the daemon binds it. Ports below
that range are given to nobody who does not ask for them by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int = 1) -> int:
    """A port P such that P .. P + count - 1 are free on 127.0.0.1 now, all below the
    ephemeral range (checked free by binding each)."""
    highest = _ephemeral_low() - count
    if highest < LOWEST:
        highest = 65535 - count
    for _ in range(200):
        port = random.randint(LOWEST, highest)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return port
    pytest.fail(f"no {count} free ports next to each other on 127.0.0.1")
