"""Triton's interpreter for kernel tests on CPU: one process with TRITON_INTERPRET=1 per test module, which runs
the snippets a test sends it (the fixture `run_interpreted`, which tests/conftest.py provides)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

# Runs each snippet it reads from stdin (a JSON string a line) in a fresh namespace and answers a JSON line on the
# stdout it started with: the snippet's printed output, or its traceback. Anything else written to fd 1 (native
# code) goes to stderr, out of the answers' way.
INTERPRETER = """
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(json.loads(line), "<snippet>", "exec"), {"__name__": "__snippet__"})
        reply = {"out": out.getvalue()}
    except BaseException:
        reply = {"error": out.getvalue() + traceback.format_exc()}
    answers.write(json.dumps(reply) + "\\n")
    answers.flush()
"""


@pytest.fixture(scope="module")
def interpreter():
    """A process with TRITON_INTERPRET=1 (read when the kernels are defined: they run on CPU tensors there), kept
    for the module: torch and Triton are imported once, not once per test."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen([sys.executable, "-c", INTERPRETER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture
def run_interpreted(interpreter):
    """Run a snippet in the interpreter process (a fresh namespace each time); its stdout."""
    def run(code: str) -> str:
        timer = threading.Timer(300, interpreter.kill)  # a hung snippet fails its test, not the suite
        timer.start()
        try:
            interpreter.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
            interpreter.stdin.flush()
            line = interpreter.stdout.readline()
        finally:
            timer.cancel()
        assert line, f"the interpreter process exited (code {interpreter.poll()})"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"][-3000:]
        return reply["out"]
    return run
