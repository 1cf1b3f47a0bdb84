"""Machine description and results files for the GPU test and benchmark runs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional


def machine_description() -> str:
    """One line: GPU name and count, driver, CUDA, torch, CPU cores (no GPU: says so)."""
    import torch

    parts = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        parts.append(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
                     f"{props.total_memory // (1 << 20)} MiB, {props.multi_processor_count} SMs")
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip().splitlines()
            if driver:
                parts.append(f"driver {driver[0]}")
        except (OSError, subprocess.SubprocessError):
            pass
        parts.append(f"CUDA {torch.version.cuda}")
    else:
        parts.append("no CUDA GPU")
    parts.append(f"torch {torch.__version__}")
    parts.append(f"{os.cpu_count()} CPUs, {platform.machine()}")
    return "; ".join(parts)


def results_dir() -> Optional[Path]:
    """``$HISPARSE_RESULTS_DIR`` (created), or None when results are not to be written."""
    value = os.environ.get("HISPARSE_RESULTS_DIR")
    if not value:
        return None
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON (atomically: temp file then rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
