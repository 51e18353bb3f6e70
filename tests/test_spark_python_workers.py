"""A local Spark's Python workers run without Spark's archives on their path, and collect
only young generations after each task (see keyq.worker.spark.daemon)."""

from __future__ import annotations

from typing import Any

from keyq.worker.spark.daemon import drop_spark_archives


def test_only_sparks_archives_and_their_importers_are_dropped() -> None:
    lib = "/opt/venv/lib/python3.11/site-packages"
    sparks = [
        f"{lib}/pyspark/python/lib/pyspark.zip",
        f"{lib}/pyspark/python/lib/py4j-0.10.9.9-src.zip",
        f"{lib}/pyspark/jars/spark-core_2.13-4.3.0.jar",
    ]
    path = ["/tmp/spark-files", *sparks, "/usr/lib/python311.zip", lib]
    importers: dict[str, object] = {entry: object() for entry in path}
    importers[f"{sparks[2]}/org"] = importers[f"{lib}/pyspark/python"] = object()
    assert drop_spark_archives(path, importers) == sparks
    assert path == ["/tmp/spark-files", "/usr/lib/python311.zip", lib]
    assert sorted(importers) == sorted([*path, f"{lib}/pyspark/python"])


def _python_worker_path(_rows: Any) -> Any:
    import sys

    import pyspark
    from pyspark import daemon

    yield [entry for entry in sys.path if entry.endswith((".zip", ".jar"))]
    yield [pyspark.__file__]
    yield [type(daemon.gc).__name__]


def test_a_local_sparks_python_workers_import_pyspark_from_the_installed_package(
    spark_engine: Any,
) -> None:
    import pyspark

    archives, where, collector = (
        spark_engine.session.sparkContext.parallelize([0], 1)
        .mapPartitions(_python_worker_path)
        .collect()
    )
    assert not [a for a in archives if a.endswith((".jar", "pyspark.zip")) or "py4j" in a]
    assert where == [pyspark.__file__]  # the driver's pyspark, not the zip's copy
    assert collector == ["_YoungGenerations"]
