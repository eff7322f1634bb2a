"""Service processes a benchmark starts on loopback (the soak and the capacity benches): `steerspec serve ...`
or `redis-server`, each with its log, restartable on its port, optionally pinned to CPUs."""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

READY_TIMEOUT_S = 180.0  # a part not serving by then did not start


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def service_env(threads: int = 1) -> Dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in (("OMP_NUM_THREADS", str(threads)), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        env.setdefault(key, value)
    return env


def die_with_parent() -> None:
    """In the child (Linux): SIGKILL it when the bench process dies, so no part outlives a killed bench."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class Part:
    """One process of the deployment, restartable on the same port."""

    name: str  # "verifier-0", "redis", ...
    kind: str  # "verifier", "drafter", "coordinator" or "redis"
    argv: List[str]
    port: int
    workdir: Path
    proc: Optional[subprocess.Popen] = None
    starts: int = 0
    cpus: Optional[Sequence[int]] = None  # pin the process to these CPUs (Linux), e.g. a placement's verifier core
    threads: int = 1  # OMP_NUM_THREADS of the process

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=service_env(self.threads), cwd=str(self.workdir), start_new_session=True,
                                         preexec_fn=self._child_setup if sys.platform.startswith("linux") else None)

    def _child_setup(self) -> None:
        """In the child: die with the parent; keep to this part's CPUs."""
        die_with_parent()
        if self.cpus:
            os.sched_setaffinity(0, set(self.cpus))

    def _ready(self) -> bool:
        if self.kind == "redis":
            return redis_ping(self.port)
        return re.search(rf"serving\b.* on 127\.0\.0\.1:{self.port}\b", self.log.read_text(errors="replace")) is not None

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """True once serving; False when it exited or did not come up within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self._ready():
                return True
            await asyncio.sleep(0.1)
        return False

    def kill(self) -> None:
        """SIGKILL (no goodbye) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, chars: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""
