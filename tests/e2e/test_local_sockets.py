"""A local run opens no listening socket outside loopback (issue #11).

A training run (trainer, weight-update group, one embedded engine) on its own private Ray, mid-rollout (the run
test_driver_signals.py then SIGTERMs): every listening TCP socket of every process of the run (the driver,
gcs_server, raylet, the dashboard and runtime-env agents, the workers, the train actor's process-group store and
gloo pairs, the engine server) must be bound to 127.0.0.1 / ::1 (or the IPv4-mapped ::ffff:127.0.0.1). Before the
fix Ray's servers listened on `*` and the node IP (Ray 2.60 resolves a loopback node IP to the routable one, see
cluster/ray_env.py), and the train actor's TCPStore on `*` (see trainer/parallel.py `rendezvous_store`).
"""

import ipaddress


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_a_local_run_listens_on_loopback_only(sigterm_mid_training_run):
    run = sigterm_mid_training_run
    # the run's own processes were found: Ray's servers, its agents and the engines
    assert "gcs_server" in run.names and "raylet" in run.names and "TrainActor" in run.names, run.names
    engines = [s for s in run.sockets if "slime_spec.engine" in s[0]]
    assert engines, run.sockets
    exposed = [s for s in run.sockets if not is_loopback(s[1])]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))
