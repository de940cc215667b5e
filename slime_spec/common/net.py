"""Network helpers shared by every layer (no torch, no ray)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ("" = every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# SGLang's own range for a port its scheduler binds later (utils/network.py get_free_port_below_ephemeral).
BELOW_EPHEMERAL = (22000, 29999)


def free_ports_below_ephemeral(count: int, host: str = "0.0.0.0", attempts: int = 256) -> list[int]:
    """`count` distinct ports free now under the kernel's ephemeral range, where SGLang picks its NCCL port: a
    port a child process binds only later must not be one the kernel hands to an outgoing connection meanwhile."""
    import random
    from pathlib import Path

    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = BELOW_EPHEMERAL[0], min(BELOW_EPHEMERAL[1], ephemeral_low - 1)
    if high - low + 1 < attempts:
        return free_ports(count, host)
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


def free_server_port(host: str = "127.0.0.1") -> int:
    """A port for a server that binds it only after a slow start (an engine binds its HTTP port after loading the
    model): under the ephemeral range, so no outgoing connection of its own children can take it meanwhile."""
    return free_ports_below_ephemeral(1, host)[0]
