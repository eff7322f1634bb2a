"""Pytest fixture `redis_url`: a real redis-server on a free loopback port (one per test session);
`RedisProcess`: one a test may kill and restart on its port.

Skips only when the `redis-server` binary is absent (`make test` installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (run `make test`, which installs it)")
    workdir = tempfile.mkdtemp(prefix="steerspec-redis-")
    for _attempt in range(3):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", workdir, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.05)
        else:
            proc.kill()
            proc.wait(timeout=5)
            continue
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            shutil.rmtree(workdir, ignore_errors=True)
        return
    pytest.fail("could not start redis-server on a loopback port")


class RedisProcess:
    """A redis-server of this test on a fixed loopback port, which the test may kill and restart."""

    def __init__(self):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (run `make test`, which installs it)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="steerspec-redis-own-")
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def redis_proc():
    """A started RedisProcess of this test alone (kill and restart it freely); removed afterwards."""
    r = RedisProcess()
    r.start()
    yield r
    r.kill()
    shutil.rmtree(r.dir, ignore_errors=True)
