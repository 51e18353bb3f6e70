"""The worker's Spark: one session per process, batches in through Arrow, results out.

``local[*]`` by default; a cluster master or a Spark Connect remote from the settings, so a
deployment that outgrows one machine points its workers at a cluster without code changes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from keyq.broker.errors import ConfigurationError
from keyq.worker.batch.decoding import Event
from keyq.worker.config import WorkerSettings, spark_options
from keyq.worker.spark.classes import jvm_file_option, jvm_word, usable_archive
from keyq.worker.spark.warm_up import warm_up

log = logging.getLogger("keyq.worker.spark")

# The driver's log configuration: warnings and errors, without the start-up banner lines.
LOG_CONFIG = Path(__file__).with_name("log4j2.properties")

# What supervisors send to stop a service: Spark's JVM is shielded from them (it stops when
# the worker does).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

BATCH_COLUMNS = (
    "stream",
    "queue",
    "key",
    "seq",
    "producer",
    "message_id",
    "published_at",
    "redelivered",
    "payload",
    "redriven",
    "body",
    "content_type",
    "headers",
)
BATCH_SCHEMA_DDL = (
    "stream string, queue string, key string, seq long, producer string, message_id string, "
    "published_at timestamp, redelivered boolean, payload string, redriven boolean, "
    "body binary, content_type string, headers map<string,string>"
)
_ARROW_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("queue", pa.string()),
        ("key", pa.string()),
        ("seq", pa.int64()),
        ("producer", pa.string()),
        ("message_id", pa.string()),
        ("published_at", pa.timestamp("ms", tz="UTC")),
        ("redelivered", pa.bool_()),
        ("payload", pa.string()),
        ("redriven", pa.bool_()),  # put back from the dead letters by ``keyq dlq redrive``
        ("body", pa.binary()),  # the message body as it was published
        ("content_type", pa.string()),
        ("headers", pa.map_(pa.string(), pa.string())),  # the publisher's own headers
    ]
)


def batch_table(stream: str, events: Sequence[Event]) -> pa.Table:
    """The batch as an Arrow table with the pipeline contract's columns, in arrival order."""
    return pa.table(
        [
            pa.array([stream] * len(events), pa.string()),
            pa.array([e.delivery.queue for e in events], pa.string()),
            pa.array([e.key for e in events], pa.string()),
            pa.array([e.seq for e in events], pa.int64()),
            pa.array([e.producer for e in events], pa.string()),
            pa.array([e.delivery.message_id for e in events], pa.string()),
            pa.array([e.published_at_ms for e in events], pa.timestamp("ms", tz="UTC")),
            pa.array([e.delivery.redelivered for e in events], pa.bool_()),
            pa.array([e.payload for e in events], pa.string()),
            pa.array([e.redrive_id is not None for e in events], pa.bool_()),
            pa.array([e.body for e in events], pa.binary()),
            pa.array([e.content_type for e in events], pa.string()),
            pa.array([e.user_headers for e in events], pa.map_(pa.string(), pa.string())),
        ],
        schema=_ARROW_SCHEMA,
    )


class SparkEngine:
    """Owns the SparkSession of a worker process."""

    def __init__(self, settings: WorkerSettings, app_name: str) -> None:
        self._settings = settings
        self._app_name = app_name
        self._session: Any = None

    @property
    def session(self) -> Any:
        if self._session is None:
            raise RuntimeError("the Spark engine is not started")
        return self._session

    def start(self, stopping: threading.Event | None = None) -> float:
        """Create the session and run a first small job (so the first batch is not slow),
        skipped if ``stopping`` is set by then, as nothing will run; returns the seconds it
        took."""
        started = time.monotonic()
        settings = self._settings
        remote = settings.spark_remote
        options = self._session_options()
        builder: Any = SparkSession.builder
        builder = builder.config(map=options)
        if remote:
            builder = builder.remote(remote)
        try:
            if not remote or remote.startswith("local"):
                self._launch_local_jvm(options)
            self._session = self._create_keeping_sigint(builder)
        except Exception as exc:  # noqa: BLE001 - Spark fails in many ways; all are config
            where = settings.spark_remote or settings.spark_master
            raise ConfigurationError(f"cannot start Spark ({where}): {exc}") from None
        if not remote:
            self._session.sparkContext.setLogLevel("ERROR")
        if stopping is None or not stopping.is_set():
            self._within_start_timeout("the first job", self._warm_up)
        elapsed = time.monotonic() - started
        log.info("spark ready in %.1fs (%s)", elapsed, self.describe())
        return elapsed

    def _session_options(self) -> dict[str, str]:
        """The session's Spark options, from the worker's settings and ``spark_conf``."""
        settings = self._settings
        remote = settings.spark_remote
        # Spark's Python workers must run an interpreter that has keyq and the pipeline; for
        # a local master (or a local Spark Connect server) that is this one. A cluster's
        # executors need keyq installed and PYSPARK_PYTHON set on their side.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        options = {
            "spark.app.name": self._app_name,
            "spark.sql.shuffle.partitions": str(settings.spark_shuffle_partitions),
            "spark.sql.session.timeZone": "UTC",
        }
        if not remote and settings.spark_master.startswith("local"):
            # Python workers without Spark's zips on their path: see keyq.worker.spark.daemon.
            options["spark.python.daemon.module"] = "keyq.worker.spark.daemon"
        options |= spark_options(settings.spark_conf)
        if not remote:
            options |= {
                "spark.master": settings.spark_master,
                "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false",
                "spark.sql.execution.arrow.pyspark.enabled": "true",
                "spark.python.worker.reuse": "true",
            }
        return options

    def _launch_local_jvm(self, options: dict[str, str]) -> None:
        """A local master, or a local Spark Connect server: a JVM of this process. -Xrs: it
        installs no handler for SIGTERM, SIGINT or SIGHUP, so the ones it is launched with
        blocked stay blocked (see _launch_jvm_apart)."""
        settings = self._settings
        jvm = f"{settings.spark_driver_java_options} -Xrs"
        if "log4j2.configurationFile" not in jvm:
            jvm += f" -Dlog4j2.configurationFile={jvm_word(LOG_CONFIG)}"
        archive = usable_archive(settings)
        if archive is not None:
            jvm += " " + jvm_file_option("SharedArchiveFile", archive)
        _launch_jvm_apart(
            {
                **options,
                "spark.master": settings.spark_remote or settings.spark_master,
                "spark.driver.extraJavaOptions": jvm,
            }
        )

    @staticmethod
    def _create_keeping_sigint(builder: Any) -> SparkSession:
        """pyspark's SparkContext installs a SIGINT handler of its own (cancel every job, raise
        KeyboardInterrupt): the daemon's is put back, so Ctrl-C stays a clean stop."""
        handler = signal.getsignal(signal.SIGINT)
        try:
            session: SparkSession = builder.getOrCreate()
        finally:
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, handler)
        return session

    def describe(self) -> str:
        return self._settings.spark_remote or self._settings.spark_master

    @property
    def local(self) -> bool:
        """Whether Spark runs in this process (a local master or local Connect server)."""
        where = self._settings.spark_remote or self._settings.spark_master
        return where.startswith("local")

    def ship(self, modules: Sequence[str]) -> None:
        """Make the pipeline's code importable where Spark runs Python, and prove it.

        A local Spark imports from this process's environment. A cluster's executors (or a
        Connect server) may not have the pipeline's module: each top-level module or package
        named is sent along (``addPyFile``, or ``addArtifacts`` on Connect), then a job
        imports every one of them there. A module that cannot be imported fails the start
        with a clear error, instead of every batch failing later (and never as the events'
        fault). keyq itself (with pyarrow and orjson) must be installed there."""
        if self.local:
            return
        # keyq itself is not sent: a copy could shadow the executors' own, of another version.
        tops = [t for t in dict.fromkeys(name.split(".", 1)[0] for name in modules) if t != "keyq"]
        with tempfile.TemporaryDirectory(prefix="keyq-ship-") as folder:
            for top in tops:
                path = _shippable(top, Path(folder))
                if path is None:
                    continue  # installed, not a file of ours: expected there too
                if self._settings.spark_remote:
                    self.session.addArtifacts(str(path), pyfile=True)
                else:
                    self.session.sparkContext.addPyFile(str(path))
                log.info("sent %s to Spark's executors", path.name)
            self._within_start_timeout(
                "the check that the executors can import " + ", ".join(modules),
                lambda: self._check_imports(modules),
            )

    def _check_imports(self, modules: Sequence[str]) -> None:
        frame = self.session.createDataFrame(pa.table({"n": [0]}), schema="n long")
        try:
            frame.mapInArrow(_importer(list(modules)), "n long").toArrow()
        except Exception as exc:  # noqa: BLE001 - Spark wraps the executor's ImportError
            text = str(exc)
            missing = re.search(r"No module named '?([\w.]+)'?", text)
            what = f"module {missing.group(1)!r}" if missing else "the pipeline's modules"
            raise ConfigurationError(
                f"Spark's executors cannot import {what}: install keyq and the pipeline's "
                f"dependencies in the executors' Python (PYSPARK_PYTHON), or ship them "
                f"with spark.submit.pyFiles in KEYQ_SPARK_CONF ({describe_spark_error(text)})"
            ) from None

    def _within_start_timeout(self, what: str, job: Callable[[], None]) -> None:
        """Run a start-up job, cancelling it past ``spark_start_timeout_s``: a cluster with
        no free cores queues it forever, silently."""
        limit = self._settings.spark_start_timeout_s
        failure: list[BaseException] = []

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                failure.append(exc)

        runner = threading.Thread(target=run, name="keyq-spark-start", daemon=True)
        runner.start()
        runner.join(limit)
        if runner.is_alive():
            self._cancel_jobs()
            runner.join(30)
            raise ConfigurationError(
                f"Spark ({self.describe()}) did not run {what} within {limit:.0f} s: does the "
                f"cluster have a worker with free cores and memory for this application? "
                f"(KEYQ_SPARK_START_TIMEOUT_S)"
            )
        if failure:
            raise failure[0]

    def _cancel_jobs(self) -> None:
        try:
            if self._settings.spark_remote:
                self.session.interruptAll()
            else:
                self.session.sparkContext.cancelAllJobs()
        except Exception:  # best effort: the start fails either way
            log.debug("cancelling Spark's start-up job failed", exc_info=True)

    def _warm_up(self) -> None:
        warm_up(self.dataframe, _ARROW_SCHEMA, self._settings.spark_shuffle_partitions)

    def dataframe(self, table: pa.Table) -> Any:
        return self.session.createDataFrame(table, schema=BATCH_SCHEMA_DDL)

    def stop(self) -> None:
        if self._session is not None:
            try:
                self._session.stop()
            except Exception:
                log.debug("spark stop failed", exc_info=True)
            self._session = None


def _launch_jvm_apart(options: dict[str, str]) -> None:
    """Launch this process's Spark JVM in a session of its own, with the stop signals blocked,
    before pyspark launches it in ours. A SIGTERM to the worker's process group (``kill --
    -PGID``, a supervisor that signals the group) then reaches only the worker, and one sent
    to every process of its cgroup (systemd's default ``KillMode=control-group``) stays
    pending in the JVM, which runs with ``-Xrs`` so that it does not unblock them: either way
    the worker finishes its batch on a Spark that is still there. The JVM still dies with the
    worker, even after kill -9: pyspark gives it a pipe as stdin and it exits when that
    closes; its Python daemon exits when the JVM goes.

    ``launch_gateway``'s ``popen_kwargs`` is pyspark's hook for how the JVM is spawned (it
    sets ``preexec_fn`` itself, hence ``start_new_session``), and pyspark uses a gateway set
    on ``SparkContext`` rather than launch its own: one JVM per process, kept, as pyspark
    keeps it."""
    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        conf = SparkConf(loadDefaults=False).setAll(list(options.items()))
        spawn = {"start_new_session": True}
        # A child inherits its parent thread's signal mask across fork and exec; a signal
        # that arrives meanwhile goes to another thread of the worker, or waits for the unblock.
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            gateway = launch_gateway(conf, popen_kwargs=spawn)  # type: ignore[no-untyped-call]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        SparkContext._ensure_initialized(gateway=gateway)


def _importer(modules: list[str]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[Any]]:
    """A mapInArrow function that imports ``modules`` where Spark runs it."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[Any]:
        for module in modules:
            importlib.import_module(module)
        yield from batches

    return run


def _shippable(top: str, folder: Path) -> Path | None:
    """A file to send for the top-level module ``top``: the module's file, or its package
    zipped; None for what lives in site-packages (installed there as here, or not at all)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None  # __main__ and the like: nothing to send
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin)
    if "site-packages" in origin.parts or "dist-packages" in origin.parts:
        return None
    if spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations)))
        archive = folder / f"{top}.zip"
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
            for path in sorted(package.rglob("*.py")):
                bundle.write(path, Path(top) / path.relative_to(package))
        return archive
    return origin


def describe_spark_error(text: str) -> str:
    """The last line of a Spark error that says something (its traces are long)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line and not line.startswith(("at ", "File "))]
    return (said[-1] if said else lines[-1] if lines else "no detail")[:300]
