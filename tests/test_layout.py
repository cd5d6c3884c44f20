"""The package layout's promises: the wire and bus layers never pull in torch, and the CLI's
control commands start without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "matplotlib")


def loaded_after(code: str) -> dict[str, bool]:
    """Which heavy modules a fresh interpreter holds after running `code`."""
    probe = (f"import sys\n{code}\n"
             f"import json; print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_schemas_and_bus_import_neither_torch_nor_transformers() -> None:
    loaded = loaded_after("import rlfabric.schemas, rlfabric.bus, rlfabric.errors, "
                          "rlfabric.transports, rlfabric.concurrency")
    assert loaded == {m: False for m in HEAVY}


@pytest.mark.parametrize("argv", [
    ["--help"], ["status", "--help"], ["ctl", "--help"], ["nats", "--help"],
    ["worker", "--help"], ["up", "--help"], ["bench", "--help"], ["schema"],
    ["gateway", "--help"],
])
def test_cli_help_and_control_commands_start_without_torch(argv: list[str]) -> None:
    code = ("from rlfabric.cli import main\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass")
    assert loaded_after(code) == {m: False for m in HEAVY}


def test_the_gateway_imports_no_torch() -> None:
    # it serves text and tokens; the model is the workers'
    loaded = loaded_after("import rlfabric.gateway, rlfabric.gateway.server, rlfabric.text")
    assert loaded["torch"] is False


def test_fabric_client_for_control_only_starts_without_torch() -> None:
    # what `rlfabric ctl` imports to pause / resume / describe
    loaded = loaded_after("from rlfabric.trainer import FabricClient, QuorumPolicy")
    assert loaded == {m: False for m in HEAVY}


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    # an editable install finds a subpackage missing from `packages`; the wheel does not
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for pkg, folder in cfg["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            if pkg == "rlfabric" and rel:
                continue
            found.add(".".join([pkg, *rel]))
    assert found == listed, f"not listed: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def _imports(path) -> set[str]:
    """Every module `path` imports (at any depth of the file: lazy imports count)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_no_engine_module_imports_the_bus() -> None:
    # engines raise engine errors; the worker runtime (rlfabric.worker) is where bus meets
    # engine and turns them into acks
    import pathlib

    root = pathlib.Path(__file__).parents[1] / "engines"
    bad = {str(p.relative_to(root.parent)): sorted(m for m in _imports(p)
                                                   if m == "rlfabric.bus"
                                                   or m.startswith("rlfabric.bus."))
           for p in root.rglob("*.py")}
    assert {p: m for p, m in bad.items() if m} == {}
    assert len(bad) >= 10  # the walk found the engines


MAX_FUNCTION_LINES = 60


def test_no_library_function_is_over_60_lines() -> None:
    # a longer one mixes concerns: split it along them (docstring and comments count)
    import ast
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).parents[1]
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    long = []
    for folder in dirs["package-dir"].values():
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n})")
    assert long == [], "functions over 60 lines:\n" + "\n".join(long)


#: what each top folder may import of the project: the graph docs/architecture.md draws
#: (`errors` is the root's module re-exporting every exception; `fabric` the root itself)
ALLOWED = {
    "schemas": set(),
    "concurrency": set(),
    "telemetry": set(),
    "text": {"schemas"},
    "bus": {"schemas", "concurrency", "telemetry"},
    "tensors": {"schemas", "text"},
    "transports": {"schemas", "concurrency", "telemetry", "bus", "tensors"},
    "engines": {"schemas", "concurrency", "telemetry", "tensors", "text"},
    "worker": {"schemas", "concurrency", "telemetry", "bus", "tensors", "transports",
               "engines"},
    "trainer": {"schemas", "concurrency", "telemetry", "bus", "tensors", "transports"},
    "gateway": {"schemas", "concurrency", "telemetry", "bus", "text"},
    "launch": {"schemas", "concurrency", "telemetry", "bus", "engines", "worker", "errors"},
    "integrations": {"schemas", "concurrency", "bus", "tensors", "trainer", "errors"},
}


def _top_folders() -> dict[str, object]:
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).parents[1]
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {("fabric" if pkg == "rlfabric" else pkg.split(".")[1]): root / folder
            for pkg, folder in dirs["package-dir"].items() if pkg.count(".") <= 1}


def test_imports_flow_the_way_the_architecture_draws() -> None:
    import ast

    found: dict[str, set[str]] = {}
    for name, folder in _top_folders().items():
        for path in folder.rglob("*.py"):  # type: ignore[attr-defined]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module == "rlfabric":
                    mods = [f"rlfabric.{a.name}" for a in node.names]  # from rlfabric import x
                elif isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    parts = m.split(".")
                    if parts[0] == "rlfabric" and len(parts) > 1 and parts[1] != name:
                        found.setdefault(name, set()).add(parts[1])
    assert set(found) >= {"bus", "worker", "trainer", "gateway"}  # the walk found them
    wrong = {name: sorted(deps - ALLOWED[name]) for name, deps in found.items()
             if name in ALLOWED and deps - ALLOWED[name]}
    assert wrong == {}, "imports against the drawn flow (docs/architecture.md)"


def test_architecture_md_lists_every_module() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    tree = doc.split("```")[3]  # the second code block: the tree
    listed: set[str] = set()
    folder: list[str] = []
    for line in tree.splitlines():
        m = re.match(r"^( *)(\S+/)\s", line)
        if m:
            depth = len(m.group(1)) // 2
            folder = [*folder[:depth], m.group(2).rstrip("/")]
            continue
        m = re.match(r"^( +)([\w.]+\.py(?:, [\w.]+\.py)*)\s", line)
        if m:
            for name in m.group(2).split(", "):
                listed.add("/".join([*folder[:len(m.group(1)) // 2], name]))
    # a package's __init__ is its folder's line (listed where it does more than re-export)
    on_disk = {str(p.relative_to(root)) for folder in _top_folders().values()
               for p in folder.rglob("*.py")  # type: ignore[attr-defined]
               if p.name != "__init__.py" or str(p.relative_to(root)) in listed}
    assert len(on_disk) > 100
    assert sorted(on_disk - listed) == [], "modules docs/architecture.md does not list"
    assert sorted(listed - on_disk) == [], "listed in docs/architecture.md, not on disk"


MAX_CLASS_LINES = 300


def test_no_class_over_300_lines_where_the_protocols_live() -> None:
    # worker/, bus/, gateway/ and engines/: a class that long owns more than one piece of state
    import ast

    big = []
    for name in ("worker", "bus", "gateway", "engines"):
        for path in sorted(_top_folders()[name].rglob("*.py")):  # type: ignore[attr-defined]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > MAX_CLASS_LINES:
                        big.append(f"{name}/{path.name}:{node.lineno} {node.name} ({n})")
    assert big == [], "classes over 300 lines:\n" + "\n".join(big)
