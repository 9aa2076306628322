"""Ports on the loopback interface, for tests that need one in a given range."""

from __future__ import annotations

import socket


def is_free(port: int) -> bool:
    """Whether nothing listens on, or holds, ``port`` on 127.0.0.1 right now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
