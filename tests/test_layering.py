"""Layers import only downwards, in the order docs/ARCHITECTURE.md states.

Every import in the package counts, also those inside functions (a lazy import still makes the
lower layer depend on the higher one). Modules of one package may import each other; two
packages of the same rank (attention and distributed) may not. The root package (`echo`) is the
public facade above every layer: its __init__ resolves names lazily, and importing it from
inside counts as importing the top.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# highest first; a module may import only from packages ranked below its own
LAYERS = [
    ("echo.__main__",),
    ("echo.entrypoints",),
    ("echo.engine",),
    ("echo.structured_output",),
    ("echo.executor",),
    ("echo.worker",),
    ("echo.core",),
    ("echo.config",),
    ("echo.models",),
    ("echo.layers",),
    ("echo.attention", "echo.distributed"),
    ("echo.sampling_params", "echo.outputs", "echo.profiling"),
    ("echo.envs",),
    ("echo_kernels",),
]


def _unit(module: str, layers, roots=()) -> tuple[int, str] | None:
    """(rank, unit) of a module: the longest layer prefix it falls under; a root package ranks
    above every layer."""
    if module in roots:
        return (-1, module)
    best = None
    for rank, units in enumerate(layers):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                if best is None or len(unit) > len(best[1]):
                    best = (rank, unit)
    return best


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from echo import envs` imports the module echo.envs
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def upward_imports(root: Path, packages: list[str], layers=LAYERS) -> list[str]:
    """Every import under root/<packages> of a module in the same or a higher layer (other than
    its own package), as 'file:line: importer -> imported'."""
    problems = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            if module in packages:
                continue  # the facade
            source = _unit(module, layers)
            assert source is not None, f"{module} is in no layer: add it to LAYERS"
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, target in _imported_modules(tree, module, path.name == "__init__.py"):
                dest = _unit(target, layers, packages)
                if dest is None or dest[1] == source[1]:
                    continue  # outside the project (torch, ...), or within its own unit
                if dest[0] <= source[0]:
                    problems.append(f"{path.relative_to(root)}:{line}: {module} -> {target}")
    return problems


def test_the_package_imports_only_downwards():
    assert upward_imports(ROOT, ["echo", "echo_kernels"]) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC_LAYERS = [("app.top",), ("app.mid",), ("app.low_a", "app.low_b")]


@pytest.mark.parametrize("importer, line, imported", [
    ("app/mid/x.py", "from app.top.y import Y", "app.top.y.Y"),  # one layer up
    ("app/low_a/x.py", "import app.mid.z", "app.mid.z"),  # plain import
    ("app/low_a/x.py", "def f():\n    from app.top import y", "app.top.y"),  # lazy
    ("app/low_a/x.py", "from app.low_b import w", "app.low_b.w"),  # same rank, other unit
    ("app/mid/sub/x.py", "from ...top import y", "app.top.y"),  # relative
    ("app/top/x.py", "import app", "app"),  # the facade above every layer
])
def test_an_upward_import_is_reported(tmp_path, importer, line, imported):
    _write(tmp_path, {
        "app/__init__.py": "", "app/top/__init__.py": "", "app/top/y.py": "Y = 1\n",
        "app/mid/__init__.py": "", "app/mid/z.py": "", "app/mid/sub/__init__.py": "",
        "app/low_a/__init__.py": "", "app/low_b/__init__.py": "", "app/low_b/w.py": "",
        importer: line + "\n",
    })
    module = importer.removesuffix(".py").replace("/", ".")
    assert upward_imports(tmp_path, ["app"], SYNTHETIC_LAYERS) == [
        f"{importer}:{line.count(chr(10)) + 1}: {module} -> {imported}"]


def test_downward_and_sibling_module_imports_are_allowed(tmp_path):
    _write(tmp_path, {
        "app/__init__.py": "", "app/top/__init__.py": "", "app/mid/__init__.py": "",
        "app/low_a/__init__.py": "", "app/low_a/w.py": "",
        "app/top/y.py": "from app.mid import z\nimport app.low_a.w\nfrom . import v\n"
                        "import torch\n",
        "app/top/v.py": "", "app/mid/z.py": "from app.low_a.w import *\n",
    })
    assert upward_imports(tmp_path, ["app"], SYNTHETIC_LAYERS) == []
