# Two images from one file, both with the `keyq` command as the entrypoint:
#
#   docker build --target slim -t keyq:slim .   # `pip install keyq`: the janitor, producers
#                                               # and operator commands (status, inspect, dlq,
#                                               # pause, resume, stream, publish, state);
#                                               # `demo --external-workers`. No Java, no Spark.
#   docker build -t keyq:local .                # the worker (the last stage, the default):
#                                               # `keyq[worker]` and Java 17; runs every command.
#
# `docker run IMAGE worker --stream orders ...`, `... janitor`, `... demo`.
#
# The base is pinned to Debian 12 (bookworm): Debian 13, which the plain `python:3.11-slim`
# tag now follows, no longer ships openjdk-17, and Spark 4 needs Java 17 or 21.
#
# Steps that change rarely come first (Java, the Python dependencies, the settings), and
# keyq's own code last, in one copy and one install: a change to keyq rebuilds two steps.

# --------------------------------------------------------------------------- slim
FROM python:3.11-slim-bookworm AS slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --user-group keyq

WORKDIR /opt/keyq-src

# keyq's own dependencies, without any extra, from pyproject.toml alone.
COPY pyproject.toml ./
RUN python -c "import pathlib, tomllib; project = tomllib.loads(pathlib.Path('pyproject.toml').read_text())['project']; pathlib.Path('/tmp/requirements.txt').write_text('\n'.join(project['dependencies']))" \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

ENTRYPOINT ["keyq"]
CMD ["--help"]

COPY . ./
RUN set -eux; \
    pip install --no-deps .; \
    rm -rf build ./*.egg-info; \
    keyq --version

USER keyq
WORKDIR /home/keyq

# --------------------------------------------------------------------------- worker
FROM python:3.11-slim-bookworm AS worker

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    JAVA_HOME=/usr/lib/jvm/java-17 \
    PYSPARK_PYTHON=/usr/local/bin/python

# Java 17 for Spark's driver JVM (the worker's local Spark). procps gives Spark's launch
# scripts `ps`. The man1 folder works around openjdk's post-install on slim images. The
# `java-17` link gives JAVA_HOME one path on every architecture (amd64, arm64). A user
# without privileges runs keyq; /data is where the compose file mounts the Parquet sink's
# volume (a new named volume takes this folder's owner).
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "/usr/lib/jvm/java-17-openjdk-$(dpkg --print-architecture)" /usr/lib/jvm/java-17; \
    /usr/lib/jvm/java-17/bin/java -version; \
    useradd --create-home --uid 10001 --user-group keyq; \
    mkdir -p /data; \
    chown keyq:keyq /data

WORKDIR /opt/keyq-src

# Dependencies first, from pyproject.toml alone (keyq's own and the worker extra's), so that
# a change to keyq's code (or to its README) does not reinstall pyspark and pyarrow.
COPY pyproject.toml ./
RUN python -c "import pathlib, tomllib; project = tomllib.loads(pathlib.Path('pyproject.toml').read_text())['project']; pathlib.Path('/tmp/requirements.txt').write_text('\n'.join(project['dependencies'] + project['optional-dependencies']['worker']))" \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

ENTRYPOINT ["keyq"]
CMD ["--help"]

# A class-data archive of the local Spark's JVM, built once at the end of this build rather
# than by every container: a worker's Spark then starts in about half the time and CPU, which
# is what a restarted or added worker costs its busy peers (docs/operations.md). About
# 160 MB; `--build-arg SPARK_CLASS_ARCHIVE=off` leaves it out (and rebuilds only from here).
ARG SPARK_CLASS_ARCHIVE=/home/keyq/spark-classes
ENV KEYQ_SPARK_CLASS_CACHE=${SPARK_CLASS_ARCHIVE}

# Then keyq itself (its dependencies are already there): the package's folders, in one copy
# (.dockerignore keeps out the tests, benchmarks and docs), and the archive.
COPY . ./
RUN set -eux; \
    pip install --no-deps .; \
    rm -rf build ./*.egg-info; \
    keyq --version; \
    if [ "$KEYQ_SPARK_CLASS_CACHE" != off ]; then \
        keyq spark-cache; \
        chown -R keyq:keyq "$KEYQ_SPARK_CLASS_CACHE"; \
    fi

USER keyq
WORKDIR /home/keyq
