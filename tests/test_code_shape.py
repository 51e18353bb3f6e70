"""The shape the product code keeps: small modules with one job, classes and functions a
reader takes in at once, one home for the idioms that were once written many times."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "producer", "worker", "janitor", "src/keyq")
MAX_MODULE_LINES = 400
MAX_CLASS_METHODS = 25
MAX_FUNCTION_LINES = 60
# Catalogues of names, one method a name: their size is their content.
CATALOGUES = {"broker/redis_keys.py:StreamKeys"}


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_module_is_over_400_lines() -> None:
    long = {
        where(path): n
        for path in modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_class_has_over_25_methods_and_no_function_over_60_lines() -> None:
    big: dict[str, int] = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                name = f"{where(path)}:{node.name}"
                if len(methods) > MAX_CLASS_METHODS and name not in CATALOGUES:
                    big[name] = len(methods)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big[f"{where(path)}:{node.name}()"] = length
    assert big == {}


def test_a_queue_is_probed_in_one_place_and_no_module_keeps_names_for_old_imports() -> None:
    probing = re.compile(r"queue_declare\([^)]*passive=True")
    found = [where(path) for path in modules() if probing.search(path.read_text())]
    assert found == ["broker/queue_probe.py"]
    # ``__all__`` belongs to a package's public face, not to re-exports kept for old imports.
    found = [
        where(path)
        for path in modules()
        if path.name != "__init__.py"
        and where(path) != "src/keyq/aio.py"
        and re.search(r"^__all__\s*=", path.read_text(), re.M)
    ]
    assert found == []
