"""A local Spark starts from a class-data archive of its JVM when one has been built
(keyq.worker.spark.classes), and as before when it has not or cannot be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keyq.broker.settings import load_settings
from keyq.worker.config import WorkerSettings
from keyq.worker.spark.classes import archive_path, build_archive, cache_folder, jvm_file_option

# Starts a local Spark in a process of its own (a process has one JVM, and the tests' own has
# started theirs), then says whether that JVM mapped the archive.
MAPS_ARCHIVE = """
import sys
from pyspark import SparkContext
from keyq.broker.settings import load_settings
from keyq.worker.config import WorkerSettings
from keyq.worker.spark.engine import SparkEngine
from keyq.worker.spark.classes import archive_path
settings = load_settings(WorkerSettings, spark_master="local[1]")
engine = SparkEngine(settings, "keyq-test-archive")
engine.start()
maps = open(f"/proc/{SparkContext._gateway.proc.pid}/maps").read()
expected = archive_path(WorkerSettings(spark_master="local[1]", spark_class_cache=sys.argv[1]))
print(str(expected) in maps)
engine.stop()
"""


def _python(
    *args: str, cache: str | None = None, **options: object
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"KEYQ_SPARK_CLASS_CACHE": cache} if cache is not None else {})}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, **options
    )


def _jvm_maps_archive(cache: str) -> bool:
    done = _python("-c", MAPS_ARCHIVE, cache, cache=cache, timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1] == "True"


def test_a_local_spark_maps_the_archive_once_it_is_built(
    spark_class_archive: Path | None,
) -> None:
    assert spark_class_archive is not None and spark_class_archive.is_file()
    cache = str(spark_class_archive.parent)
    assert _jvm_maps_archive(cache)
    assert not _jvm_maps_archive("off")


def test_a_build_that_fails_leaves_nothing_behind(tmp_path: Path) -> None:
    bad_jvm = {"spark_driver_java_options": "-XX:+NoSuchOptionAnywhere"}
    settings = load_settings(WorkerSettings, spark_class_cache=str(tmp_path), **bad_jvm)
    assert build_archive(settings) is None
    assert list(tmp_path.iterdir()) == []


def test_the_cli_prints_the_archive_and_refuses_when_switched_off(
    spark_class_archive: Path | None,
) -> None:
    assert spark_class_archive is not None
    built = _python("-m", "keyq", "spark-cache", timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(spark_class_archive)
    off = _python("-m", "keyq", "spark-cache", cache="off", timeout=120)
    assert off.returncode == 2
    assert "off" in off.stderr


@pytest.mark.parametrize("value", ["off", "OFF", "none", "0", "false", ""])
def test_the_archive_can_be_switched_off(value: str) -> None:
    assert cache_folder(WorkerSettings(spark_class_cache=value)) is None
    assert archive_path(WorkerSettings(spark_class_cache=value)) is None


def test_the_archive_is_named_for_its_jvm_options_and_lives_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = archive_path(WorkerSettings())
    other = archive_path(WorkerSettings(spark_driver_java_options="-XX:+UseSerialGC"))
    assert default is not None and other is not None
    assert default.parent == tmp_path / "keyq"
    assert default != other
    chosen = archive_path(WorkerSettings(spark_class_cache=str(tmp_path / "elsewhere")))
    assert chosen is not None and chosen.parent == tmp_path / "elsewhere"


def test_a_path_with_spaces_stays_one_jvm_option() -> None:
    plain, quoted = "/var/cache/keyq/a.jsa", '/my cache/"k"/a.jsa'
    assert jvm_file_option("SharedArchiveFile", plain) == f"-XX:SharedArchiveFile={plain}"
    assert jvm_file_option("SharedArchiveFile", quoted) == (
        '-XX:SharedArchiveFile="/my cache/\\"k\\"/a.jsa"'
    )


def test_a_user_without_a_home_gets_no_archive_rather_than_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert cache_folder(WorkerSettings()) is None
    assert archive_path(WorkerSettings()) is None


def test_the_archive_is_named_for_when_sparks_jars_were_installed() -> None:
    """A virtual environment made again in the same folder has the same paths but new jars,
    and a JVM refuses an archive built against the old ones: the name must change."""
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    before = archive_path(WorkerSettings())
    was = os.stat(jars)
    try:
        os.utime(jars, ns=(was.st_atime_ns, was.st_mtime_ns + 1))  # as if installed anew
        assert archive_path(WorkerSettings()) != before
    finally:
        os.utime(jars, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert archive_path(WorkerSettings()) == before
