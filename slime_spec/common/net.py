"""Network helpers shared by every layer (no torch, no ray)."""

from __future__ import annotations

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


def free_ports(count: int, host: str = "0.0.0.0", attempts: int = 256) -> list[int]:
    """`count` distinct TCP ports free on `host` now ("" = every interface), under the kernel's ephemeral range as
    SGLang picks its NCCL port: whoever binds a port later (a server after a slow start, a rendezvous, a Ray head)
    must not find it handed meanwhile to an outgoing connection of this or another process."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = BELOW_EPHEMERAL[0], min(BELOW_EPHEMERAL[1], ephemeral_low - 1)
    if high - low + 1 < attempts:  # a kernel whose ephemeral range starts low: nothing below it to pick from
        return _kernel_chosen_ports(count, host)
    found: list[int] = []
    for port in random.sample(range(low, high + 1), attempts):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports in {low}-{high} after {attempts} tries")


def free_port(host: str = "0.0.0.0") -> int:
    """One port, as `free_ports` picks them."""
    return free_ports(1, host)[0]
