"""The layer table of DESIGN.md, read from the imports of src/: which package may import which,
no import cycles between modules, and the pure core loads no torch."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "spotpipe"

# package -> the spotpipe packages it may import (DESIGN.md, "Layers"); top-level modules
# (config, job, faults, factories, notices, runfiles, traces) are shared and checked below
ALLOWED = {
    "schedule": set(),
    "plan": {"schedule"},
    "protocol": set(),
    "store": {"protocol"},
    "model": {"plan"},
    "data": set(),
    "runtime": {"schedule", "plan", "protocol", "store", "model", "data"},
    "checkpoint": {"runtime", "protocol", "store", "model"},
    "cluster": {"plan", "protocol", "store", "schedule", "checkpoint", "model"},
    "sim": {"schedule", "plan", "protocol"},
}
PACKAGES = set(ALLOWED) | {"cli", "bench"}
# the pure core: standard library only (no torch, no numpy), so planners and the simulator run
# anywhere and quickly
PURE = ("schedule", "plan", "protocol", "sim")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def _imports() -> dict[str, set[str]]:
    """module -> the spotpipe modules it imports (anywhere in the file, lazily too)."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out[name] |= {a.name for a in node.names if a.name.startswith("spotpipe")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if target.startswith("spotpipe"):
                    for alias in node.names:
                        full = f"{target}.{alias.name}"
                        out[name].add(full if (SRC.parent / full.replace(".", "/")).with_suffix(
                            ".py").exists() or (SRC.parent / full.replace(".", "/")).is_dir()
                            else target)
        out.setdefault(name, set())
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_follow_the_layer_table():
    wrong = []
    for module, targets in sorted(_imports().items()):
        pkg = _package(module)
        if pkg not in ALLOWED:
            continue
        for target in sorted(targets):
            other = _package(target)
            if other == pkg or other not in PACKAGES:
                continue
            if other not in ALLOWED[pkg]:
                wrong.append(f"{module} imports {target} ({pkg} -> {other})")
    assert not wrong, "imports the layer table forbids:\n" + "\n".join(wrong)


def test_pure_packages_import_only_pure_top_level_modules():
    """The core may use shared top-level modules only when those are themselves pure."""
    imports = _imports()
    wrong = []
    for module, targets in sorted(imports.items()):
        if _package(module) not in PURE:
            continue
        for target in targets:
            if _package(target) not in PACKAGES and target.count(".") == 1:
                if _package(target) not in ("traces", "runfiles"):
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules():
    imports = _imports()
    graph = {m: {t for t in ts if t in imports} for m, ts in imports.items()}
    # a package's __init__ re-exporting its own modules is not a cycle of design
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t.startswith(m + ".") or m.startswith(t + "."):
                continue  # a package and its own modules
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_pure_core_loads_no_torch():
    code = ("import sys\n"
            "import spotpipe.schedule, spotpipe.plan, spotpipe.plan.recovery, spotpipe.protocol\n"
            "import spotpipe.sim, spotpipe.sim.simulator, spotpipe.sim.policies\n"
            "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == "", f"the pure core loaded {proc.stdout.strip()}"
