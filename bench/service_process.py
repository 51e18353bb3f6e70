"""Which process on this machine serves a URL (the broker or Redis a benchmark talks to), so
its CPU can be read from ``/proc``."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from bench import proc_cpu

LOOPBACK = {"localhost", "127.0.0.1", "::1", ""}


def _port_of(url: str, default: int) -> tuple[str, int]:
    first = url.split(",", 1)[0]
    parts = urlsplit(first if "://" in first else f"x://{first}")
    return parts.hostname or "", parts.port or default


def service_pid(
    url: str, default_port: int, comm: str, fallback: Sequence[str]
) -> tuple[int | None, str]:
    """The pid of the server ``url`` names, and how it was found: the process listening on
    its port, else the one process called ``comm`` whose command line or environment holds
    one of ``fallback`` (in turn). None when the server is not on this machine."""
    host, port = _port_of(url, default_port)
    if not is_this_machine(host):
        return None, f"{host} is not this machine"
    pid = proc_cpu.listener_pid(port)
    if pid is not None:
        return pid, f"listening on port {port}"
    for needle in fallback:
        found = proc_cpu.pids_named(comm, needle)
        if len(found) == 1:
            return found[0], f"the one {comm} naming {needle!r}"
    return None, f"no process found listening on port {port}"


def is_this_machine(host: str) -> bool:
    """Whether ``host`` is a loopback address or one of this machine's names."""
    if host in LOOPBACK:
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
        own = {socket.gethostbyname(name) for name in (socket.gethostname(), socket.getfqdn())}
    except (OSError, ValueError):
        return False
    return address.is_loopback or str(address) in own
