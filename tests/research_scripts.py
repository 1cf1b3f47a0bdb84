"""Loading a script of scripts/ as a module, for the tests of the research scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at ``ROOT / relative`` executed as a module named by its file stem. Side effect:
    registered in ``sys.modules`` under that name (dataclasses resolve their module there, and a
    worker pool pickles its jobs by module name)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
