"""A class-data archive of a local Spark's JVM: with it, the JVM maps the classes Spark
needs at start instead of loading, verifying and linking them one by one, and a worker's
Spark starts in a little over half the time and CPU (about 4 s instead of 7 s, idle).
A worker that is started while its peers carry the load (a restart, a scale-up) takes less
of their CPU, and serves sooner.

The archive is built once per Java, pyspark installation (its jars are the JVM's classpath)
and JVM options (``keyq spark-cache``, or the demo before it starts its workers), by a Spark
that starts, runs a batch-shaped job and exits; the JVM writes it at exit
(``-XX:ArchiveClassesAtExit``, Java 13 and later). It is written under a name of its own and
renamed into place only when that JVM exited cleanly, so a worker never maps a partial
archive. A worker uses it when it is there, and starts as before when it is not; a JVM that
finds the archive does not match its own build or classpath ignores it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from keyq.broker.settings import load_settings
from keyq.worker.config import WorkerSettings

log = logging.getLogger("keyq.worker.spark")

OFF = ("off", "none", "0", "false", "")
BUILD_TIMEOUT_S = 600.0


def cache_folder(settings: WorkerSettings) -> Path | None:
    """Where archives live: ``KEYQ_SPARK_CLASS_CACHE``, else the user's cache folder;
    None when switched off."""
    value = settings.spark_class_cache
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # a user without a home (a container's bare uid): no archive
            return None
    return Path(base) / "keyq"


def archive_path(settings: WorkerSettings) -> Path | None:
    """The archive for this Java, pyspark and JVM options (whether built or not); None when
    switched off or there is no Java to name."""
    folder = cache_folder(settings)
    java = _java()
    if folder is None or java is None:
        return None
    import pyspark  # noqa: PLC0415 - heavy: only when a local Spark is wanted

    real = os.path.realpath(java)
    installed = os.path.dirname(os.path.realpath(pyspark.__file__))
    jars = os.path.join(installed, "jars")
    stamp = "|".join(
        [
            str(pyspark.__version__),
            installed,  # the jars' path: the JVM's classpath
            # ... and when they were installed: a JVM refuses an archive whose jars changed,
            # as they do when a virtual environment is made again in the same folder.
            str(os.stat(jars).st_mtime_ns) if os.path.isdir(jars) else "",
            real,
            str(os.stat(real).st_mtime_ns),
            settings.spark_driver_java_options,
        ]
    )
    digest = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return folder / f"spark-classes-{digest}.jsa"


def usable_archive(settings: WorkerSettings) -> Path | None:
    """The archive a local Spark should start with, if it has been built."""
    path = archive_path(settings)
    return path if path is not None and path.is_file() else None


def build_archive(settings: WorkerSettings) -> Path | None:
    """Build the archive if it is missing (about 20 s, once); returns it, or None when
    switched off or the build failed (logged: Spark then starts as it would without)."""
    target = archive_path(settings)
    if target is None or target.is_file():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    command = [
        sys.executable,
        *("-m", "keyq.worker.spark.classes"),
        *("--out", str(partial), "--java-options", settings.spark_driver_java_options),
    ]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if done.returncode != 0 or not partial.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            log.warning(
                "could not build Spark's class-data archive (exit %s): %s",
                done.returncode,
                " / ".join(tail) or "no output",
            )
            return None
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not build Spark's class-data archive: %s", exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()
    log.info("built Spark's class-data archive %s", target)
    return target


def jvm_file_option(flag: str, path: Path | str) -> str:
    """``-XX:<flag>=<path>`` as one word of Spark's JVM options, which are split at spaces
    unless quoted."""
    return f"-XX:{flag}={jvm_word(path)}"


def jvm_word(path: Path | str) -> str:
    """A path as (part of) one word of Spark's JVM options: quoted when it holds spaces."""
    text = str(path)
    if any(char.isspace() for char in text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").is_file():
        return str(Path(home, "bin", "java"))
    return shutil.which("java")


def _dump(out: str, java_options: str) -> None:
    """Start a local Spark that writes the archive to ``out`` when its JVM exits, run the
    warm-up job (the shape of a batch), stop it, and wait for the JVM to finish writing."""
    from pyspark import SparkContext  # noqa: PLC0415 - only in the child that dumps

    from keyq.worker.spark.engine import SparkEngine  # noqa: PLC0415 - imports Spark

    settings = load_settings(
        WorkerSettings,
        spark_master="local[1]",
        spark_class_cache="off",
        spark_driver_java_options=f"{java_options} {jvm_file_option('ArchiveClassesAtExit', out)}",
    )
    engine = SparkEngine(settings, "keyq-spark-cache")
    engine.start()
    engine.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:
        raise RuntimeError("no Spark JVM of this process to wait for")
    proc.stdin.close()  # the JVM exits when its stdin closes, and dumps the archive then
    if proc.wait(timeout=BUILD_TIMEOUT_S) != 0:
        raise RuntimeError(f"Spark's JVM exited with {proc.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Dump a class-data archive of Spark's JVM.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--java-options", required=True)
    args = parser.parse_args()
    _dump(args.out, args.java_options)


if __name__ == "__main__":
    main()
