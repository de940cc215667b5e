"""fleet/process.py: server process lifecycle against trivial child processes (python's http.server), no Ray."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from slime_spec.common.net import free_port
from slime_spec.fleet.process import EngineStartError, ServerProcess


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purpose
        return f.read().split()[2] != "Z"


def _http_server(tmp_path, with_health=True, extra_child=False, with_ready=False):
    root = tmp_path / "www"
    root.mkdir(exist_ok=True)
    if with_health:
        (root / "health").write_text("ok")
    if with_ready:  # SGLang's /ready
        (root / "ready").write_text("")
    port = free_port()
    serve = f"{sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {root}"
    # `extra_child`: the server forks a grandchild, as SGLang's launcher does; both must stop together.
    cmd = f"sleep 300 & echo child=$! ; exec {serve}" if extra_child else f"exec {serve}"
    return ServerProcess(["bash", "-c", cmd], host="127.0.0.1", port=port, log_path=tmp_path / "server.log")


def test_start_health_and_stop_kills_group(tmp_path):
    proc = _http_server(tmp_path, extra_child=True)
    proc.start(timeout_s=30)
    assert requests.get(f"{proc.url}/health").text == "ok"
    deadline = time.time() + 10
    while proc.log_path.read_text().count("child=") < 2 and time.time() < deadline:  # 1st: the logged argv
        time.sleep(0.05)
    child = int(proc.log_path.read_text().split("child=")[-1].split()[0])
    assert _pid_alive(proc.pid) and _pid_alive(child)
    proc.stop()
    assert not proc.alive() and not _pid_alive(child)
    proc.stop()  # idempotent


def test_a_hung_stopped_server_ends_on_sigterm(tmp_path):
    """A hung server (SIGSTOPped group) takes SIGTERM once continued: it exits by SIGTERM, not by the SIGKILL that
    follows the grace period."""
    import signal

    proc = _http_server(tmp_path)
    proc.start(timeout_s=30)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert proc.stop() == -signal.SIGTERM and not proc.alive()


def test_restart_uses_same_argv_and_url(tmp_path):
    proc = _http_server(tmp_path)
    proc.start(timeout_s=30)
    first = proc.pid
    os.kill(first, 9)
    proc.proc.wait()
    assert not proc.alive()
    proc.start(timeout_s=30)
    assert proc.pid != first and requests.get(f"{proc.url}/health").status_code == 200
    proc.stop()


def test_server_that_dies_at_start_reports_exit_code_and_log_tail(tmp_path):
    script = ("import sys\nfor i in range(100): print(f'line {i}')\n"
              "print('ValueError: bad --speculative-num-steps')\nsys.exit(3)")
    proc = ServerProcess([sys.executable, "-c", script], host="127.0.0.1", port=free_port(),
                         log_path=tmp_path / "bad.log")
    with pytest.raises(EngineStartError) as e:
        proc.start(timeout_s=30)
    err = e.value
    assert err.exit_code == 3
    assert "bad --speculative-num-steps" in str(err) and "slime-spec doctor" in str(err)
    assert "line 99" in err.log_tail and "line 10\n" not in err.log_tail  # only the tail


def test_ready_is_sglangs_ready_route_where_the_server_has_it(tmp_path):
    """SGLang's /ready (startup and warmup done, not paused) answers at once; /health, which generates a token and
    polls once a second, is asked only by a server without /ready."""
    proc = _http_server(tmp_path, with_health=False, with_ready=True)
    proc.start(timeout_s=30)
    try:
        assert requests.get(f"{proc.url}/health").status_code == 404  # never needed
    finally:
        proc.stop()


def test_a_server_without_ready_is_asked_for_it_once(tmp_path):
    """A server whose /ready answers 404 has no such route (an SGLang before it): every later poll asks /health
    alone, not /ready then /health."""
    import threading

    proc = _http_server(tmp_path, with_health=False)

    def healthy_after_two_health_polls():  # counted in the server's log, whatever the machine's speed
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.log_path.exists() and proc.log_path.read_text().count("GET /health") >= 2:
                break
            time.sleep(0.05)
        (tmp_path / "www" / "health").write_text("ok")

    threading.Thread(target=healthy_after_two_health_polls, daemon=True).start()
    proc.start(timeout_s=30)
    try:
        log = proc.log_path.read_text()
        assert log.count("GET /ready") == 1 and log.count("GET /health") >= 3, log
    finally:
        proc.stop()


def test_server_that_never_gets_healthy_is_stopped(tmp_path):
    proc = _http_server(tmp_path, with_health=False)  # /health answers 404
    with pytest.raises(EngineStartError, match="did not become ready.*--engine-start-timeout.*HTTP 404"):
        proc.start(timeout_s=1.5)
    assert not proc.alive()


def test_server_dies_with_a_killed_parent(tmp_path):
    """A SIGKILLed driver or Ray actor (no atexit, no finally) must not orphan its engine server."""
    import subprocess

    root = tmp_path / "www"
    root.mkdir()
    (root / "health").write_text("ok")
    parent_code = f"""
import sys, time
from slime_spec.fleet.process import ServerProcess
from slime_spec.common.net import free_port
port = free_port()
p = ServerProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", {str(root)!r}],
                  host="127.0.0.1", port=port, log_path={str(tmp_path / "s.log")!r})
p.start(timeout_s=30)
print(p.pid, flush=True)
time.sleep(300)
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    assert _pid_alive(server_pid)
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while _pid_alive(server_pid) and time.time() < deadline:
        time.sleep(0.05)
    orphaned = _pid_alive(server_pid)
    if orphaned:
        os.kill(server_pid, 9)  # do not leave it behind when the test fails
    assert not orphaned


def test_start_waits_while_the_server_is_alive_and_not_yet_serving(tmp_path):
    """No fixed start-up deadline: a slow server (big checkpoint, CUDA graphs) is waited for while it lives."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "health").write_text("ok")
    port = free_port()
    proc = ServerProcess(["bash", "-c", f"sleep 3; exec {sys.executable} -m http.server {port} --bind 127.0.0.1 "
                                        f"--directory {root}"], host="127.0.0.1", port=port,
                         log_path=tmp_path / "slow.log")
    t0 = time.monotonic()
    proc.start(timeout_s=None)
    try:
        assert time.monotonic() - t0 >= 3 and requests.get(f"{proc.url}/health").text == "ok"
    finally:
        proc.stop()



def test_an_embedded_engine_that_fails_to_load_exits_with_its_reason(tmp_path):
    """The scheduler process fails (no weights), SGLang's launcher raises: the whole server exits, its detokenizer
    process included, and the start reports the reason instead of waiting out the start timeout."""
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_server import EngineServer

    model = make_tiny_model(tmp_path / "model", arch="llama")
    for f in model.glob("*.safetensors"):
        f.unlink()
    server = EngineServer(model, [], log_path=tmp_path / "engine.log").launch()
    with pytest.raises(EngineStartError) as e:
        server.wait_ready(timeout_s=300)
    assert e.value.exit_code not in (None, 0) and "no *.safetensors files" in e.value.log_tail, str(e.value)
    assert not server.process.alive()


# Test double for SGLang's server when uvicorn cannot bind: it logs uvicorn's error and stays alive (SGLang's
# warmup keeps the process up); on a free port it serves /health.
BIND_OR_HANG = r"""
import http.server, os, sys, time
os.chdir(os.path.dirname(os.path.abspath(__file__)))  # serves ./health
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
except OSError:
    print("ERROR:    [Errno 98] error while attempting to bind on address "
          f"('127.0.0.1', {port}): address already in use", flush=True)
    time.sleep(300)
server.serve_forever()
"""


@pytest.mark.parametrize("retries", [0, 1])
def test_a_server_that_cannot_bind_its_port_moves_or_fails_at_once(tmp_path, retries):
    (tmp_path / "health").write_text("ok")
    script = tmp_path / "bind_or_hang.py"
    script.write_text(BIND_OR_HANG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ServerProcess([sys.executable, str(script), "--port", str(port)], host="127.0.0.1", port=port,
                             log_path=tmp_path / "server.log", port_retries=retries)
        if retries:
            proc.start(timeout_s=120)  # the start timeout is far; the bind failure is seen in seconds
            try:
                assert proc.port != port and requests.get(f"{proc.url}/health").text == "ok"
            finally:
                proc.stop()
        else:
            with pytest.raises(EngineStartError, match="address already in use"):
                proc.start(timeout_s=120)
            assert not proc.alive()


# Test double for a server whose uvicorn could not bind and that exited before the start noticed, the holder of the
# port gone by then: the first launch logs uvicorn's error and exits 1; a later one serves /health.
BIND_FAILED_THEN_EXITED = r"""
import http.server, os, sys
os.chdir(os.path.dirname(os.path.abspath(__file__)))
port = int(sys.argv[sys.argv.index("--port") + 1])
if not os.path.exists("launched"):
    open("launched", "w").close()
    print("ERROR:    [Errno 98] error while attempting to bind on address "
          f"('127.0.0.1', {port}): address already in use", flush=True)
    sys.exit(1)
http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_server_that_exited_after_failing_to_bind_is_moved_even_once_the_port_is_free(tmp_path):
    (tmp_path / "health").write_text("ok")
    script = tmp_path / "bind_failed.py"
    script.write_text(BIND_FAILED_THEN_EXITED)
    port = free_port()
    proc = ServerProcess([sys.executable, str(script), "--port", str(port)], host="127.0.0.1", port=port,
                         log_path=tmp_path / "server.log", port_retries=1)
    try:
        proc.start(timeout_s=120)
        assert proc.port != port and requests.get(f"{proc.url}/health").text == "ok"
    finally:
        proc.stop()


def test_an_engine_on_a_port_it_chose_moves_when_the_port_is_taken_one_on_a_given_port_does_not():
    from slime_spec.config.run_config import EngineConfig
    from slime_spec.fleet.process import engine_server_process

    engine = EngineConfig(backend="embedded", model_path="/m")
    assert engine_server_process(engine, log_path="/tmp/unused.log").port_retries == 2
    assert engine_server_process(engine, log_path="/tmp/unused.log", port=free_port()).port_retries == 0


@pytest.mark.parametrize("user_value", [None, "1"])
def test_the_embedded_engine_stops_without_sglangs_crash_diagnostics_pause(user_value):
    """SGLang's TokenizerManager sleeps 5 s before its py-spy / CUDA-coredump diagnostics on every SIGTERM; the
    embedded engine turns both off unless the user set them, read through SGLang's own env registry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_") or "BEFORE_CRASH" not in k}
    if user_value is not None:
        env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] = user_value
    code = ("import slime_spec.engine.__main__\n"
            "from sglang.srt.environ import envs\n"
            "print(envs.SGLANG_PYSPY_DUMP_BEFORE_CRASH.get(), envs.SGLANG_CUDA_COREDUMP_BEFORE_CRASH.get())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == (["True", "False"] if user_value else ["False", "False"])


@pytest.mark.parametrize("device,method", [("cpu", "fork"), ("cuda", "spawn")])
def test_a_cpu_engine_forks_sglangs_children_after_sglang_sets_spawn(device, method):
    """SGLang sets `spawn` in `_set_envs_and_config`, before it starts any child; a CPU engine's launcher forks them
    (they share its imports), right after SGLang's own set-up, which still runs; a CUDA engine keeps `spawn`."""
    code = ("import inspect, multiprocessing as mp\n"
            "import slime_spec.engine.__main__ as main\n"  # first: it installs the stand-ins SGLang's import needs
            "from sglang.srt.entrypoints import engine\n"
            "assert 'mp.set_start_method(\"spawn\", force=True)' in inspect.getsource(engine._set_envs_and_config)\n"
            "calls = []\n"
            "engine._set_envs_and_config = lambda a: (calls.append(a), mp.set_start_method('spawn', force=True))\n"
            f"main.fork_children_on_cpu({device!r})\n"
            "engine._set_envs_and_config('server_args')\n"
            "print(calls, mp.get_start_method())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["['server_args']", method]
