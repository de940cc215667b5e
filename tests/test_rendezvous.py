"""A process-group store's port is listened on from its pick to the store (common/net.py `listen_socket`).

The trainer's default group (trainer/parallel.py `rendezvous_store`) and the weight-update group's rank 0
(common/dist_group.py `join_group`) serve their stores on such a socket: no other process can take the port in
between, and a peer that connects before the store runs waits in the listener's backlog instead of retrying
against a closed port (a retry can be handed that port as its source and connect to itself).
"""

import socket
import threading
import time
from datetime import timedelta

import pytest

from slime_spec.common.net import BELOW_EPHEMERAL, listen_host, listen_socket
from slime_spec.trainer.parallel import rendezvous_store


def test_the_port_is_held_from_its_pick():
    listener = listen_socket("127.0.0.1")
    try:
        port = listener.getsockname()[1]
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        if low > BELOW_EPHEMERAL[0] + 256:
            assert BELOW_EPHEMERAL[0] <= port <= min(BELOW_EPHEMERAL[1], low - 1)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        listener.close()


def test_listen_host_is_loopback_only_for_a_loopback_address():
    assert listen_host("127.0.0.1") == "127.0.0.1" and listen_host("::1") == "::1"
    assert listen_host("192.0.2.2") == "" and listen_host("node-0") == ""


@pytest.mark.parametrize("listen", ["127.0.0.1", ""], ids=["loopback", "every_interface"])
def test_a_peer_that_connects_before_the_store_runs_joins_it(listen):
    listener = listen_socket(listen)
    port, timeout = listener.getsockname()[1], timedelta(seconds=30)
    joined: dict = {}

    def rank1():
        try:
            store = rendezvous_store(1, 2, "127.0.0.1", port, timeout)
            store.set("from1", "b")
            joined["value"] = store.get("from0")
        except Exception as e:  # reported by the assertion below
            joined["error"] = e

    peer = threading.Thread(target=rank1)
    peer.start()
    time.sleep(1.0)  # rank 1 is connected to the bare listener by now
    store = rendezvous_store(0, 2, "127.0.0.1", port, timeout, listener)
    store.set("from0", "a")
    assert store.get("from1") == b"b"
    peer.join(30)
    assert not peer.is_alive() and joined.get("value") == b"a", joined


def test_only_rank_0_hosts_a_weight_update_group_store():
    from slime_spec.common.dist_group import join_group
    listener = listen_socket("127.0.0.1")
    try:
        with pytest.raises(ValueError, match="only rank 0 hosts"):
            join_group("127.0.0.1", listener.getsockname()[1], 1, 2, "g", "gloo", timedelta(seconds=5), listener)
    finally:
        listener.close()
