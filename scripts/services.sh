#!/usr/bin/env bash
# Make sure RabbitMQ and Redis are reachable before tests or the demo.
#
# Usage: scripts/services.sh [--check] [--test-tools]
#
# Reads KEYQ_AMQP_URL and KEYQ_REDIS_URL. A reachable service is used as is.
# An unreachable *local* one is started (and, as root with apt-get, installed
# first). If that is impossible but a Docker engine answers, the compose file's
# rabbitmq and redis services are started (`docker compose up -d --wait`; they
# publish the default ports, and COMPOSE_FILE may layer others) and awaited at
# the same URLs; `docker compose down -v` stops them. Otherwise it says why per
# service and exits 1.
#
# --test-tools (make test) also installs what only the tests use, when it is missing and it
# can (as root with apt-get): promtool (Debian's prometheus package), which checks
# deploy/prometheus's alert rules, and Debian's chromium and chromium-driver, which the
# console's browser tests drive; otherwise it says so, and those tests fail in CI (skip
# elsewhere) naming the package. The demo needs none of them.
#
# --check only probes and reports; it never starts or installs anything.
#
# Passwords are never printed: URLs are shown with the password as `***`.
set -euo pipefail

AMQP_URL="${KEYQ_AMQP_URL:-amqp://guest:guest@localhost:5672/%2F}"
REDIS_URL="${KEYQ_REDIS_URL:-redis://localhost:6379/0}"
RABBIT_WAIT_S=90
REDIS_WAIT_S=15
COMPOSE_WAIT_S=180

MODE=fix
TEST_TOOLS=0
for argument in "$@"; do
    case "$argument" in
        --check) MODE=check ;;
        --test-tools) TEST_TOOLS=1 ;;
        -h | --help)
            sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "keyq services: unknown argument '$argument' (expected --check or --test-tools)" >&2
            exit 2
            ;;
    esac
done

say() { echo "keyq services: $*"; }

if ! command -v python3 >/dev/null 2>&1; then
    say "python3 is required to parse KEYQ_AMQP_URL / KEYQ_REDIS_URL" >&2
    exit 1
fi

# parse_url KIND URL -> "host<TAB>port<TAB>redacted-url" on stdout.
# Done in Python so IPv6 literals, percent-encoding and default ports are
# handled correctly; the raw URL is never echoed, even when it is invalid.
parse_url() {
    python3 -c '
import re, sys, urllib.parse as up
kind, url = sys.argv[1], sys.argv[2]
ports = {"amqp": {"amqp": 5672, "amqps": 5671}, "redis": {"redis": 6379, "rediss": 6379}}[kind]
try:
    p = up.urlsplit(url)
    port = p.port or ports[p.scheme.lower()]
    host = p.hostname
    assert host
except Exception:
    sys.exit(f"not a valid {kind} URL (scheme {kind} or {kind}s, host required)")
netloc = p.netloc
if p.password is not None:
    userinfo, _, hostport = netloc.rpartition("@")
    netloc = userinfo.partition(":")[0] + ":***@" + hostport
query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", p.query)
print(host, port, up.urlunsplit((p.scheme, netloc, p.path, query, p.fragment)), sep="\t")
' "$1" "$2"
}

# probe HOST PORT: succeed if a TCP connection is accepted within 2 s;
# on failure print a short reason.
probe() {
    python3 -c '
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except socket.gaierror:
    sys.exit("cannot resolve host")
except ConnectionRefusedError:
    sys.exit("connection refused")
except TimeoutError:
    sys.exit("timed out after 2 s")
except OSError as e:
    sys.exit(e.strerror or type(e).__name__)
' "$1" "$2" 2>&1
}

# wait_port HOST PORT SECONDS
wait_port() {
    local deadline=$((SECONDS + $3))
    while ((SECONDS < deadline)); do
        probe "$1" "$2" >/dev/null && return 0
        sleep 1
    done
    return 1
}

is_local() {
    case "$1" in
        localhost | 127.0.0.1 | ::1) return 0 ;;
        *) return 1 ;;
    esac
}

APT_UPDATED=0
# apt_install PACKAGE [OPTION...]: install quietly, running `apt-get update` at most once.
apt_install() {
    if ((APT_UPDATED == 0)); then
        apt-get update -qq >&2 || return 1
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

# start_rabbitmq HOST PORT: REASON is set when it fails.
start_rabbitmq() {
    local host=$1 port=$2
    # A node may already be up (e.g. auto-started by the Debian package, or
    # running with another listener port): starting a second one would only
    # fail on the node-name clash, so wait for it to finish booting instead.
    if timeout 20 rabbitmqctl -q status >/dev/null 2>&1; then
        timeout "$RABBIT_WAIT_S" rabbitmqctl -q await_startup >/dev/null 2>&1 || true
        if wait_port "$host" "$port" 5; then
            STARTED="local RabbitMQ node (already running, now ready)"
            return 0
        fi
        REASON="a local RabbitMQ node is running but does not listen on port $port"
        return 1
    fi
    if ! RABBITMQ_NODE_PORT=$port rabbitmq-server -detached >&2; then
        REASON="rabbitmq-server -detached failed"
        return 1
    fi
    if wait_port "$host" "$port" "$RABBIT_WAIT_S"; then
        timeout 30 rabbitmqctl -q await_startup >/dev/null 2>&1 || true
        STARTED="started local RabbitMQ"
        return 0
    fi
    REASON="started rabbitmq-server but port $port did not open within ${RABBIT_WAIT_S} s (see /var/log/rabbitmq)"
    return 1
}

# start_redis HOST PORT: REASON is set when it fails.
start_redis() {
    local host=$1 port=$2 bind=127.0.0.1
    [[ $host == "::1" ]] && bind="::1"
    # Explicit pidfile: the implicit /var/run/redis.pid may belong to another instance.
    if ! redis-server --daemonize yes --bind "$bind" --port "$port" --save "" --appendonly no \
        --pidfile "${TMPDIR:-/tmp}/keyq-redis-$port.pid" >&2; then
        REASON="redis-server failed to start"
        return 1
    fi
    if wait_port "$host" "$port" "$REDIS_WAIT_S"; then
        STARTED="started local Redis"
        return 0
    fi
    REASON="started redis-server but port $port did not open within ${REDIS_WAIT_S} s"
    return 1
}

# start_locally BINARY PACKAGE STARTER HOST PORT: install BINARY if need be and can be, then
# start it; REASON is set when that fails.
start_locally() {
    local binary=$1 package=$2 starter=$3
    if ! command -v "$binary" >/dev/null 2>&1; then
        if [[ $(id -u) -ne 0 ]]; then
            REASON="$binary is not installed and we are not root to install it"
            return 1
        fi
        if ! command -v apt-get >/dev/null 2>&1; then
            REASON="$binary is not installed and apt-get is unavailable"
            return 1
        fi
        echo "keyq services: installing $package with apt-get: $name is not running and not installed" >&2
        if ! apt_install "$package" || ! command -v "$binary" >/dev/null 2>&1; then
            REASON="apt-get install $package failed"
            return 1
        fi
    fi
    "$starter" "$4" "$5"
}

FAILURES=()
# The local services that could not be started here, for docker compose: the compose
# service's name, and "host<TAB>port<TAB>shown-url<TAB>name" to await it at.
COMPOSED=()
COMPOSED_AT=()

# ensure NAME KIND URL BINARY PACKAGE STARTER
ensure() {
    local name=$1 kind=$2 url=$3 binary=$4 package=$5 starter=$6
    local parsed host port shown why
    if ! parsed=$(parse_url "$kind" "$url" 2>&1); then
        FAILURES+=("$name: KEYQ_${kind^^}_URL is $parsed")
        return
    fi
    IFS=$'\t' read -r host port shown <<<"$parsed"

    if why=$(probe "$host" "$port"); then
        say "$name reachable at $shown"
        return
    fi
    local prefix="$name not reachable at $shown ($why)"
    if [[ $MODE == check ]]; then
        FAILURES+=("$prefix")
        return
    fi
    if ! is_local "$host"; then
        FAILURES+=("$prefix; host '$host' is not local, so it cannot be started here")
        return
    fi
    REASON="" STARTED=""
    if start_locally "$binary" "$package" "$starter" "$host" "$port"; then
        say "$STARTED at $shown"
    else
        FAILURES+=("$prefix; $REASON")
        COMPOSED+=("${name,,}")
        COMPOSED_AT+=("$host"$'\t'"$port"$'\t'"$shown"$'\t'"$name")
    fi
}

# compose_up: start COMPOSED with the compose file (COMPOSE_FILE may layer an override) and
# wait until each is healthy and answers at its URL. A published port accepts connections
# before the service behind it does, hence `--wait` on the compose file's health checks.
compose_up() {
    local at host port shown name output
    say "a Docker engine answers: docker compose up -d --wait ${COMPOSED[*]}"
    if ! output=$(cd "$(dirname "$0")/.." && docker compose up -d --wait \
        --wait-timeout "$COMPOSE_WAIT_S" "${COMPOSED[@]}" 2>&1); then
        echo "$output" >&2
        if [[ $output == *rlimit* ]]; then
            say "the Docker engine may not raise RabbitMQ's open-files limit to ${KEYQ_RABBITMQ_NOFILE:-65536}: set KEYQ_RABBITMQ_NOFILE to the engine's own (docker-compose.yml)" >&2
        else
            say "docker compose could not start ${COMPOSED[*]} (see above; docker compose logs ${COMPOSED[*]})" >&2
        fi
        return 1
    fi
    for at in "${COMPOSED_AT[@]}"; do
        IFS=$'\t' read -r host port shown name <<<"$at"
        if ! wait_port "$host" "$port" 10; then
            say "$name is up in docker compose but not at $shown: the compose file publishes 5672 and 6379 (COMPOSE_FILE may layer other ports)" >&2
            return 1
        fi
        say "$name reachable at $shown (docker compose; \`docker compose down -v\` removes it)"
    done
}

docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1 &&
        docker compose version >/dev/null 2>&1
}

# ensure_tool BINARY PACKAGE WHAT: install a tool the tests use, never a failure here (the
# tests that need it say what is missing).
ensure_tool() {
    local binary=$1 package=$2 what=$3
    command -v "$binary" >/dev/null 2>&1 && return 0
    if [[ $MODE == check ]]; then
        say "$binary is not installed ($what)"
    elif [[ $(id -u) -ne 0 ]]; then
        say "$binary is not installed and we are not root to install it ($what): apt-get install $package"
    elif ! command -v apt-get >/dev/null 2>&1; then
        say "$binary is not installed and apt-get is unavailable ($what)"
    else
        echo "keyq services: installing $package with apt-get: $what" >&2
        # Without recommends (for prometheus: a node exporter, disk and IPMI tools).
        if apt_install "$package" --no-install-recommends &&
            command -v "$binary" >/dev/null 2>&1; then
            say "installed $binary ($package)"
        else
            say "apt-get install $package failed: $binary is missing ($what)"
        fi
    fi
}

if ((TEST_TOOLS)); then
    ensure_tool promtool prometheus "the tests check deploy/prometheus's alert rules with promtool"
    ensure_tool chromium chromium "the console's browser tests drive chromium headless"
    ensure_tool chromedriver chromium-driver "the console's browser tests drive chromium through chromedriver"
fi

ensure RabbitMQ amqp "$AMQP_URL" rabbitmq-server rabbitmq-server start_rabbitmq
ensure Redis redis "$REDIS_URL" redis-server redis-server start_redis

((${#FAILURES[@]} == 0)) && exit 0

for f in "${FAILURES[@]}"; do
    say "$f" >&2
done
# Every failure a local service that could not be started: docker compose starts them all.
if [[ $MODE == fix ]] && ((${#COMPOSED[@]} == ${#FAILURES[@]})); then
    if docker_answers; then
        compose_up && exit 0
    else
        say "no Docker engine (with Compose v2) answers either, to run ${COMPOSED[*]} in containers" >&2
    fi
fi
exit 1
