"""The verifier's default KV-cache budget (--max-cache-mb): a share of the device's memory.

Without a limit a replica accepts sessions until it runs out of memory; with one it answers
RESOURCE_EXHAUSTED and the coordinator places the session on another replica.
"""

from __future__ import annotations

import os

import torch

CUDA_SHARE = 0.8  # of the memory free on the GPU once the weights are loaded
CPU_SHARE = 0.25  # of the memory available to this process on a CPU host


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def default_cache_mb(device) -> float:
    """MB of KV cache a replica on `device` may hold: CUDA_SHARE of the GPU's free memory, else
    CPU_SHARE of the host's available memory (at least 64 MB)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        budget = free * CUDA_SHARE
    else:
        budget = _cpu_available_bytes() * CPU_SHARE
    return max(64.0, budget / 2**20)
