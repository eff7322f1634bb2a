"""The machine a benchmark ran on, for its JSON: CPU model, cores, torch and the CPU kernel settings.

CPU timings depend on the processor as much as on the code (MKL's small-row GEMMs are fast on one
x86 vendor's cores and slow on another's; see models/layouts.py), so every report says where it ran.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Dict, Optional

import torch

from steerspec.models.layouts import onednn_min_rows, out_major_rows


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[str]:
    """The processor's model name (Linux /proc/cpuinfo), else platform.processor(), else None."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_info(**lms) -> Dict[str, object]:
    """CPU model, logical cores, torch version, its CPU capability and the layout settings in force;
    for each named FastCachedLM given, the row count from which its passes read oneDNN copies (one
    row too where this machine measured them faster, models/kv.py)."""
    info = {"cpu": cpu_model(), "logical_cores": os.cpu_count(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_min_rows": onednn_min_rows(), "out_major_rows": sorted(out_major_rows())}
    for name, lm in lms.items():
        info[f"{name}_onednn_min_rows"] = getattr(lm, "onednn_min_rows", None)
    return info
