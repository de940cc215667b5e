"""A local run opens no listening socket outside loopback (issue #11).

A training run (trainer, weight-update group, one embedded engine) on its own private Ray, mid-rollout:
every listening TCP socket of every process of the run (the driver, gcs_server, raylet, the dashboard and
runtime-env agents, the workers, the train actor's process-group store and gloo pairs, the engine server)
must be bound to 127.0.0.1 / ::1 (or the IPv4-mapped ::ffff:127.0.0.1). Before the fix Ray's servers listened
on `*` and the node IP (Ray 2.60 resolves a loopback node IP to the routable one, see cluster/ray_env.py), and the
train actor's TCPStore on `*` (see trainer/parallel.py `loopback_store`).
"""

import ipaddress

import psutil

from tests.e2e.run_processes import Run, describe, make_run_inputs


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    out = []
    for p in procs:
        try:
            out += [(describe(p), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_a_local_run_listens_on_loopback_only(tmp_path):
    model, data = make_run_inputs(tmp_path)
    run = Run(tmp_path, model, data, "sockets", train=True)
    try:
        run.wait_mid_rollout()
        procs = run.processes()
        names = " ".join(p.name() for p in procs)
        # the run's own processes were found: Ray's servers, its agents and the engines
        assert "gcs_server" in names and "raylet" in names and "TrainActor" in names, names
        sockets = listening(procs)
        engines = [s for s in sockets if "slime_spec.engine" in s[0]]
        assert engines, sockets
        exposed = [s for s in sockets if not is_loopback(s[1])]
        assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))
    finally:
        run.stop()
