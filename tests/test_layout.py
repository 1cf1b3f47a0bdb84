"""The package's shape: wings whose imports point down, test and analysis code outside the runtime,
small classes and functions (docs/design.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = [ROOT / "sglang_hisparse", ROOT / "patches"]
# A wing may import its own floor and the floors below it, never one above.
FLOORS = {"ground": 0, "cpu": 1, "resolver": 1, "memory": 2, "decode": 3, "prefix": 3, "serving": 4, "tools": 4, "patches": 4}
NOT_RUNTIME = ("sglang_hisparse_testkit", "sglang_hisparse_analysis")
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60


def runtime_modules() -> list[Path]:
    return sorted(p for root in RUNTIME for p in root.rglob("*.py"))


def wing_of_path(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "patches":
        return "patches"
    return rel[1] if len(rel) > 2 else "ground"


def wing_of_module(module: str) -> str:
    """The wing an imported module belongs to (``sglang_hisparse.kernels`` and the top-level
    modules are the ground floor; other packages are named by their first part)."""
    parts = module.split(".")
    if parts[0] != "sglang_hisparse":
        return parts[0]
    if len(parts) > 1 and parts[1] in FLOORS:  # also ``from sglang_hisparse.resolver import cuda``
        return parts[1]
    return "ground"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] in ("sglang_hisparse",) + NOT_RUNTIME]


def test_the_runtime_never_imports_test_or_analysis_code():
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in runtime_modules()
                 for line, m in imported_modules(p) if m.split(".")[0] in NOT_RUNTIME]
    assert offenders == []


def test_every_import_points_to_the_same_floor_or_below():
    upward = []
    for path in runtime_modules():
        wing = wing_of_path(path)
        for line, module in imported_modules(path):
            target = wing_of_module(module)
            if FLOORS[target] > FLOORS[wing]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({wing}) imports {module} ({target})")
    assert upward == []


def test_the_floor_check_sees_an_upward_import():
    """The check above can fail: an import from memory/ into decode/ is reported."""
    assert FLOORS[wing_of_module("sglang_hisparse.decode.coordinator")] > FLOORS["memory"]
    assert wing_of_path(ROOT / "sglang_hisparse" / "memory" / "allocator.py") == "memory"
    assert wing_of_path(ROOT / "sglang_hisparse" / "config.py") == "ground"


def oversized(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            found.append(f"class {node.name} {lines} lines")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
            found.append(f"function {node.name} {lines} lines")
    return [f"{path.relative_to(ROOT)}: {what}" for what in found]


@pytest.mark.parametrize("root", ["sglang_hisparse", "patches", "sglang_hisparse_testkit", "sglang_hisparse_analysis"])
def test_classes_and_functions_stay_small(root):
    too_big = [line for p in sorted((ROOT / root).rglob("*.py")) for line in oversized(p)]
    assert too_big == [], f"classes <= {MAX_CLASS_LINES} lines, functions <= {MAX_FUNCTION_LINES}"
