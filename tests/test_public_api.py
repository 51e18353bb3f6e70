"""The public API: ``from keyq import Producer, Worker, Janitor`` and every error, resolved on
first use, so a producer's import never loads Spark."""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys

import pytest

import keyq
from keyq.broker import errors


def test_every_public_name_resolves_to_its_home_and_no_other_name_does() -> None:
    for name in keyq.__all__:
        value = getattr(keyq, name)
        assert getattr(value, "__name__", name) == name
    assert sorted(keyq.__all__) == sorted(keyq._HOMES)
    with pytest.raises(AttributeError, match="Prodcuer"):
        keyq.Prodcuer  # type: ignore[attr-defined]  # noqa: B018


def test_every_keyq_error_is_public() -> None:
    tree = {
        name
        for name, value in inspect.getmembers(errors, inspect.isclass)
        if issubclass(value, errors.KeyqError)
    }
    assert tree <= set(keyq.__all__), tree - set(keyq.__all__)


def test_dir_lists_the_api_and_its_installed_version_not_the_machinery() -> None:
    listed = dir(keyq)
    assert set(keyq.__all__) <= set(listed)
    assert not {"importlib", "TYPE_CHECKING", "_HOMES"} & set(listed)
    assert "__version__" in listed
    assert keyq.__version__ == importlib.metadata.version("keyq")


def test_a_producer_import_does_not_load_spark() -> None:
    probe = (
        "import sys; from keyq import Producer, KeyqError; import keyq.broker.locks; "
        "print('pyspark' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
