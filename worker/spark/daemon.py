"""The Python daemon a local Spark forks its Python workers from, without Spark's archives.

Spark puts ``pyspark.zip``, py4j's zip and the Spark jar first on its Python workers' path.
Python compiles a module imported from a zip every time (it caches no bytecode there), and
before every task Spark's worker clears the import caches, which on Python 3.11 makes it read
each archive's directory again (the jar's holds about 13,000 entries). A local master runs
this very interpreter, where pyspark is installed as a package with the same code: this
daemon drops the archives from the path, then runs Spark's own daemon, whose forked workers
inherit the path.

It also makes the collection Spark's daemon runs after every task of a reused worker a
collection of the young generations: a full one walks every object of pyspark, pandas and
pyarrow (11-18 ms a task on an idle machine). Python's own thresholds still run full
collections, so cyclic garbage a task leaves in the old generation is still freed.

Run only by Spark (``spark.python.daemon.module``), and only for a local master.
"""

from __future__ import annotations

import gc
import sys


def _is_spark_archive(entry: str) -> bool:
    """Spark's own zips and jars on the path: pyspark's and py4j's sources, the Spark jar."""
    name = entry.replace("\\", "/").rsplit("/", 1)[-1]
    return (
        name == "pyspark.zip"
        or (name.startswith("py4j-") and name.endswith(".zip"))
        or name.endswith(".jar")
    )


def drop_spark_archives(path: list[str], importers: dict[str, object]) -> list[str]:
    """Remove Spark's archives from ``path`` and their importers (also those of folders
    inside them) from ``importers``; returns what was removed."""
    removed = [entry for entry in path if _is_spark_archive(entry)]
    path[:] = [entry for entry in path if entry not in removed]
    for cached in list(importers):
        if any(cached == entry or cached.startswith(entry + "/") for entry in removed):
            del importers[cached]
    return removed


class _YoungGenerations:
    """Stands in for the ``gc`` module in Spark's daemon."""

    @staticmethod
    def collect() -> int:
        return gc.collect(1)


def main() -> None:
    drop_spark_archives(sys.path, sys.path_importer_cache)  # type: ignore[arg-type]
    from pyspark import daemon  # noqa: PLC0415 - only once the path is clean

    # Its one use of gc is the collection after each task.
    daemon.gc = _YoungGenerations()  # type: ignore[attr-defined,assignment]
    daemon.manager()


if __name__ == "__main__":
    main()
