"""Importing the pipeline a worker is given as ``module:function``, before any service is
contacted and without Spark: whatever goes wrong (a module found nowhere, a syntax error, an
exception its code raises, a name it lacks) becomes one ``ConfigurationError`` naming the file
and line to fix, not a traceback."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from keyq.broker.errors import ConfigurationError

# Frames of the import itself (this module, importlib's own and frozen code) are no place to fix.
_IMPORT_MACHINERY = ("<frozen ", os.path.dirname(importlib.__file__), __file__)


def load_pipeline(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (or ``module.function``); a module found nowhere else is
    looked for in the working directory."""
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ConfigurationError(f"pipeline {spec!r} must be written module:function")
    _search_working_directory(module_name)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - its code may raise anything
        raise ConfigurationError(f"pipeline {spec} failed to import: {_where(exc)}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        where = getattr(module, "__file__", None) or module_name
        found = "missing" if function is None else f"of type {type(function).__name__}"
        raise ConfigurationError(
            f"pipeline {spec} failed to import: {attribute!r} is not a function: "
            f"in {where} it is {found}"
        )
    return function  # type: ignore[no-any-return]


def _where(exc: BaseException) -> str:
    """``Kind at file:line: message``, the place being the code that raised (for a syntax
    error, the bad line); without a place when only the import machinery ran."""
    kind = type(exc).__name__
    if isinstance(exc, SyntaxError):
        place = f"{exc.filename}:{exc.lineno}" if exc.filename else None
        message = exc.msg
    else:
        frames = [
            frame
            for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith(_IMPORT_MACHINERY)
        ]
        place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
        message = str(exc)
    return f"{kind} at {place}: {message}" if place else f"{kind}: {message}"


def _search_working_directory(module_name: str) -> None:
    """``keyq worker --pipeline app:pipeline`` run from the folder holding ``app.py`` finds it
    (the ``keyq`` script alone would not: its own folder heads ``sys.path``). The folder goes
    last, and only when the module is not found otherwise, so it never shadows an installed
    package. Spark's local Python workers, which import the pipeline's functions by module
    name, are told the same through ``PYTHONPATH``: they start later, from this environment."""
    top = module_name.split(".", maxsplit=1)[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return
    except (ImportError, ValueError):
        return  # let the import itself say what is wrong
    folder = os.getcwd()
    if folder not in sys.path:
        sys.path.append(folder)
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])
