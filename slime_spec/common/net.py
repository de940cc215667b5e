"""Network helpers shared by every layer (no torch, no ray)."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

# SGLang's own range for a port its scheduler binds later (utils/network.py get_free_port_below_ephemeral).
BELOW_EPHEMERAL = (22000, 29999)


def _kernel_chosen_ports(count: int, host: str) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _candidate_ports(attempts: int) -> list[int] | None:
    """Ports to try, under the kernel's ephemeral range as SGLang picks its NCCL port; None on a kernel whose
    ephemeral range starts so low that nothing below it is left (the kernel then picks)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = BELOW_EPHEMERAL[0], min(BELOW_EPHEMERAL[1], ephemeral_low - 1)
    if high - low + 1 < attempts:
        return None
    return random.sample(range(low, high + 1), attempts)


def free_ports(count: int, host: str = "0.0.0.0", attempts: int = 256) -> list[int]:
    """`count` distinct TCP ports free on `host` now ("" = every interface), under the kernel's ephemeral range as
    SGLang picks its NCCL port: whoever binds a port later (a server after a slow start, a rendezvous, a Ray head)
    must not find it handed meanwhile to an outgoing connection of this or another process. A port this process
    listens on itself comes from `listen_socket` instead, which leaves no such gap."""
    candidates = _candidate_ports(attempts)
    if candidates is None:
        return _kernel_chosen_ports(count, host)
    found: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports in {BELOW_EPHEMERAL} after {attempts} tries")


def listen_socket(host: str = "0.0.0.0", attempts: int = 256) -> socket.socket:
    """A TCP socket already listening on `host` ("" = every interface), at a port picked as `free_ports` picks
    them, for a store this process hosts (a process group's rendezvous). Held from the pick on, the port cannot go
    to anyone else before the store starts, and a peer told the port finds a listener there: a peer that connects
    to a port nobody listens on yet retries, and a retry can be handed that very port as its own source port and
    connect to itself (seen as a rendezvous that waited for a client until its timeout)."""
    for port in _candidate_ports(attempts) or [0]:
        try:
            return listen_on(host, port)
        except OSError:
            continue
    raise RuntimeError(f"no free port to listen on in {BELOW_EPHEMERAL} after {attempts} tries")


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port; "" = every interface, IPv4 and IPv6 where the kernel has both (as torch's
    TCPStore server listens)."""
    if host == "" and socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128)


def listen_host(address: str) -> str:
    """Where a store for peers reaching it at `address` listens: that loopback address for a local run (nothing
    off the machine can reach it), every interface otherwise (as torch's TCPStore server does)."""
    try:
        return address if ipaddress.ip_address(address).is_loopback else ""
    except ValueError:  # a host name
        return ""


def free_port(host: str = "0.0.0.0") -> int:
    """One port, as `free_ports` picks them."""
    return free_ports(1, host)[0]
