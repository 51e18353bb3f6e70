"""Which of keyq's optional extras are installed, so a command that needs one says what to
install in one line instead of failing deep inside an import.

``pip install keyq`` is the producer SDK and the operator commands; ``keyq[worker]`` adds
Spark (pyspark, pyarrow, pandas), which ``keyq worker``, ``keyq spark-cache`` and a demo with
its own workers need.
"""

from __future__ import annotations

from importlib.util import find_spec

from keyq.broker.errors import ConfigurationError

WORKER_EXTRA = "pip install 'keyq[worker]'"
WORKER_MODULES = ("pyspark", "pyarrow", "pandas")


def missing_worker_modules() -> list[str]:
    """The worker extra's top-level modules that cannot be imported here."""
    return [module for module in WORKER_MODULES if find_spec(module) is None]


def require_worker_extra(what: str) -> None:
    """Raise ConfigurationError (exit 2 from the CLI) naming the install that ``what`` needs,
    if any of Spark's modules is missing."""
    missing = missing_worker_modules()
    if missing:
        raise ConfigurationError(
            f"{what} needs Spark ({', '.join(missing)} not installed): {WORKER_EXTRA}"
        )


def is_worker_module(name: str | None) -> bool:
    """Whether a missing module ``name`` (``ModuleNotFoundError.name``) belongs to the worker
    extra."""
    return name is not None and name.partition(".")[0] in {*WORKER_MODULES, "py4j"}
