"""Helpers shared by the coordinator test files (reference outputs, service subprocesses)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
_MODELS: Dict[str, object] = {}


def load_cached(model_dir) -> object:
    from steerspec.models import load_model

    key = str(model_dir)
    if key not in _MODELS:
        _MODELS[key] = load_model(model_dir)
    return _MODELS[key]


@torch.inference_mode()
def greedy_reference(model_dir, prompt_ids: Sequence[int], n: int) -> List[int]:
    """The verifier's own greedy continuation (n tokens, no EOS stop), with a KV cache."""
    from transformers import DynamicCache

    from steerspec.models.loading import cache_kwarg

    model = load_cached(model_dir)
    cache = {cache_kwarg(model): DynamicCache(config=model.config)}  # filled in place, call after call
    out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True, **cache)
    tokens: List[int] = []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **cache)
    return tokens


def service_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def spawn_service(kind: str, model_dir, *extra: str) -> Tuple[subprocess.Popen, str]:
    """Start `python -m steerspec serve KIND --port 0 --model DIR` -> (process, log file); see wait_ready."""
    cmd = [sys.executable, "-m", "steerspec", "serve", kind, "--port", "0", "--model", str(model_dir),
           "--threads", "1", *extra]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"steerspec-{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=service_env(), cwd=str(ROOT))
    return proc, log.name


def wait_ready(proc: subprocess.Popen, log: str, timeout_s: float = 120.0) -> str:
    """The 'host:port' a spawned service printed once serving (kills it and raises on failure)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r" on (127\.0\.0\.1:\d+)", Path(log).read_text())
        if match:
            return match.group(1)
        time.sleep(0.05)
    kill(proc)
    raise RuntimeError(f"service did not start: {Path(log).read_text()[-2000:]}")


def start_service(kind: str, model_dir, *extra: str, timeout_s: float = 120.0) -> Tuple[subprocess.Popen, str]:
    proc, log = spawn_service(kind, model_dir, *extra)
    return proc, wait_ready(proc, log, timeout_s)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
