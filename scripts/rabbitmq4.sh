#!/usr/bin/env bash
# RabbitMQ 4.3 and Valkey 9 for keyq, beside the machine's own RabbitMQ and Redis.
#
# Usage: scripts/rabbitmq4.sh setup|start|stop|status|env|ctl ARGS...|reset
#
#   setup   make a Debian forky (testing) root holding rabbitmq-server (4.3, Erlang 29),
#           valkey-server (9) and util-linux, at $KEYQ_FORKY_ROOT (default
#           /var/cache/keyq-forky); an existing root is kept. ~3 minutes and 1 GB the first
#           time. Run as root; needs debootstrap (installed with apt-get if missing).
#   start   start node keyq4@localhost and a Valkey from that root, on 127.0.0.1 only:
#             AMQP        $KEYQ4_AMQP_PORT        (5702)
#             management  $KEYQ4_MGMT_PORT        (15703, guest/guest)
#             prometheus  $KEYQ4_PROMETHEUS_PORT  (15702: /metrics, /metrics/per-object...)
#             Valkey      $KEYQ4_VALKEY_PORT      (6392, AOF on)
#           distribution $KEYQ4_DIST_PORT (25702), its own epmd on $KEYQ4_EPMD_PORT (4370);
#           data, configuration and logs in the root's $KEYQ4_DATA (/var/lib/keyq4). Another
#           pair can run beside it with other ports, KEYQ4_DATA and KEYQ4_NODE (keyq4).
#           Every deprecated feature of the release is denied (deprecated_features.permit.*
#           = false), so what 4.x deprecates fails here as it will in the next major.
#   stop    stop both, with the epmd; nothing of them keeps running.
#   status  versions and ports of what runs.
#   env     the KEYQ_* settings that point keyq at them: eval "$(scripts/rabbitmq4.sh env)"
#   ctl     rabbitmqctl against keyq4@localhost only, e.g. `ctl list_queues name type`
#   reset   stop, then wipe the node's and Valkey's data (the next start is empty)
#
# Binaries of the root need its own libc, so they run under chroot, each in a mount namespace
# of its own (unshare) where /proc, /sys and /dev are mounted: no mount is left on the host,
# and the machine's node (rabbit@localhost, 5672, epmd 4369) and Redis (6379) are never
# touched; every rabbitmqctl names keyq4@localhost with -n.
set -euo pipefail

ROOT=${KEYQ_FORKY_ROOT:-/var/cache/keyq-forky}
AMQP_PORT=${KEYQ4_AMQP_PORT:-5702}
MGMT_PORT=${KEYQ4_MGMT_PORT:-15703}
PROMETHEUS_PORT=${KEYQ4_PROMETHEUS_PORT:-15702}
DIST_PORT=${KEYQ4_DIST_PORT:-25702}
EPMD_PORT=${KEYQ4_EPMD_PORT:-4370}
VALKEY_PORT=${KEYQ4_VALKEY_PORT:-6392}
NODE=${KEYQ4_NODE:-keyq4}@localhost
# Inside the root: the node's and Valkey's data, configuration and logs.
DATA=${KEYQ4_DATA:-/var/lib/keyq4}
PACKAGES="rabbitmq-server valkey-server util-linux ca-certificates"

say() { echo "keyq rabbitmq4: $*"; }
die() {
    echo "keyq rabbitmq4: $*" >&2
    exit 1
}

need_root() { [[ $(id -u) -eq 0 ]] || die "run as root (chroot, mount namespaces)"; }

root_ready() {
    [[ -x $ROOT/usr/lib/rabbitmq/bin/rabbitmq-server && -x $ROOT/usr/bin/valkey-server &&
        -x $ROOT/usr/bin/setpriv ]] && grep -qw localhost "$ROOT/etc/hosts" 2>/dev/null
}

# The mirror apt uses here (deb822 sources first, then sources.list).
mirror() {
    local found
    found=$(grep -hm1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' || true)
    [[ -n $found ]] || found=$(grep -hm1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' || true)
    echo "${found:-http://deb.debian.org/debian}"
}

setup() {
    need_root
    if root_ready; then
        say "forky root ready at $ROOT ($(versions))"
        return
    fi
    if ! command -v debootstrap >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    mkdir -p "$ROOT"
    if [[ ! -x $ROOT/usr/bin/apt-get ]]; then
        local script=/usr/share/debootstrap/scripts/forky
        # bookworm's debootstrap has no forky script: sid's serves any unstable-like suite
        [[ -e $script ]] || script=/usr/share/debootstrap/scripts/sid
        say "debootstrap forky into $ROOT (log: $ROOT.debootstrap.log)"
        debootstrap --variant=minbase forky "$ROOT" "$(mirror)" "$script" \
            >"$ROOT.debootstrap.log" 2>&1 || die "debootstrap failed: see $ROOT.debootstrap.log"
    fi
    # Packages must not start services inside the root while they are installed.
    printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
    chmod +x "$ROOT/usr/sbin/policy-rc.d"
    # The mirror's forky Release file may be past its Valid-Until date: do not check it.
    in_root root /bin/sh -c "export DEBIAN_FRONTEND=noninteractive
        apt-get -o Acquire::Check-Valid-Until=false update -qq &&
        apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null"
    # Erlang resolves "localhost" in node names: the root needs a hosts file saying it.
    [[ -s $ROOT/etc/hosts ]] || cp /etc/hosts "$ROOT/etc/hosts"
    grep -qw localhost "$ROOT/etc/hosts" || echo "127.0.0.1 localhost" >>"$ROOT/etc/hosts"
    root_ready || die "the root at $ROOT still lacks rabbitmq-server, valkey-server or setpriv"
    say "forky root ready at $ROOT ($(versions))"
}

versions() {
    chroot "$ROOT" dpkg-query -W -f='${Package} ${Version}  ' rabbitmq-server valkey-server \
        erlang-base 2>/dev/null || true
}

# in_root USER COMMAND...: run COMMAND inside the root as USER, in a mount namespace of its own
# with /proc, /sys and /dev mounted (gone with the namespace), with a clean environment.
# setpriv, not runuser/su: forky's PAM limits would put the open-files limit back to 1024.
in_root() {
    local user=$1
    shift
    ${TIMEOUT:+timeout "$TIMEOUT"} unshare --mount --propagation private -- /bin/sh -ec '
        root=$1; user=$2; epmd=$3; home=$4; shift 4
        mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
        mountpoint -q "$root/sys" || mount -t sysfs sys "$root/sys"
        mountpoint -q "$root/dev" || mount --rbind /dev "$root/dev"
        exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
            HOME="$home" ERL_EPMD_PORT="$epmd" ERL_EPMD_ADDRESS=127.0.0.1 \
            setpriv --reuid="$user" --regid="$user" --init-groups -- "$@"
    ' in-root "$ROOT" "$user" "$EPMD_PORT" "$DATA/home" "$@"
}

node_env() {
    echo RABBITMQ_NODENAME=$NODE RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT="$AMQP_PORT" RABBITMQ_DIST_PORT="$DIST_PORT" \
        RABBITMQ_MNESIA_BASE=$DATA/mnesia RABBITMQ_LOG_BASE=$DATA/log \
        RABBITMQ_CONFIG_FILE=$DATA/rabbitmq.conf RABBITMQ_CONF_ENV_FILE=$DATA/rabbitmq-env.conf \
        RABBITMQ_ENABLED_PLUGINS_FILE=$DATA/enabled_plugins RABBITMQ_PID_FILE=$DATA/pid
}

ctl() {
    # shellcheck disable=SC2046 # node_env's words are NAME=value pairs without spaces
    in_root rabbitmq env $(node_env) /usr/lib/rabbitmq/bin/rabbitmqctl -n "$NODE" "$@"
}

# The deprecated features of RabbitMQ 4.3 (rabbitmqctl list_deprecated_features): all denied.
DEPRECATED_FEATURES="amqp_address_v1 amqp_filter_set_bug classic_queue_mirroring global_qos
    management_metrics_collection queue_master_locator ram_node_type transient_nonexcl_queues"

configure() {
    local config
    mkdir -p "$ROOT$DATA"/{home,mnesia,log,valkey}
    config="listeners.tcp.default = 127.0.0.1:$AMQP_PORT
management.tcp.ip = 127.0.0.1
management.tcp.port = $MGMT_PORT
prometheus.tcp.ip = 127.0.0.1
prometheus.tcp.port = $PROMETHEUS_PORT
log.console = false
log.file.level = info
"
    for feature in $DEPRECATED_FEATURES; do
        config+="deprecated_features.permit.$feature = false
"
    done
    printf '%s' "$config" >"$ROOT$DATA/rabbitmq.conf"
    echo '[rabbitmq_management,rabbitmq_prometheus].' >"$ROOT$DATA/enabled_plugins"
    : >"$ROOT$DATA/rabbitmq-env.conf"
    printf '%s\n' "bind 127.0.0.1" "port $VALKEY_PORT" "dir $DATA/valkey" \
        "pidfile $DATA/valkey/valkey.pid" "logfile $DATA/valkey/valkey.log" "daemonize yes" \
        "appendonly yes" "appendfsync everysec" 'save ""' >"$ROOT$DATA/valkey.conf"
    local cookie=$ROOT$DATA/home/.erlang.cookie
    [[ -s $cookie ]] || head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F >"$cookie"
    chmod 400 "$cookie"
    chroot "$ROOT" chown rabbitmq:rabbitmq $DATA
    chroot "$ROOT" chown -R rabbitmq:rabbitmq $DATA/home $DATA/mnesia $DATA/log
    chroot "$ROOT" chown -R valkey:valkey $DATA/valkey
}

# The node in the foreground (start runs this in the background).
serve() {
    # shellcheck disable=SC2046
    in_root rabbitmq env $(node_env) \
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1} -start_epmd false" \
        /usr/lib/rabbitmq/bin/rabbitmq-server
}

valkey_answers() { in_root valkey valkey-cli -p "$VALKEY_PORT" ping >/dev/null 2>&1; }
epmd_answers() { in_root rabbitmq epmd -port "$EPMD_PORT" -names >/dev/null 2>&1; }

start() {
    need_root
    root_ready || die "no forky root at $ROOT: run scripts/rabbitmq4.sh setup first"
    configure
    # As many open files as the sandbox or host allows (the node needs one per connection
    # and queue segment); the default 1024 stops a node with many queues.
    ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
    valkey_answers || in_root valkey valkey-server $DATA/valkey.conf
    epmd_answers || in_root rabbitmq epmd -port "$EPMD_PORT" -address 127.0.0.1 -daemon
    if ! ctl -q status >/dev/null 2>&1; then
        # In a session of its own, so that it outlives this script and the caller's terminal.
        setsid nohup "$0" _serve >"$ROOT$DATA/console.log" 2>&1 </dev/null &
        local deadline=$((SECONDS + 180))
        until ctl -q await_startup --timeout 10 >/dev/null 2>&1; do
            ((SECONDS < deadline)) || die "RabbitMQ did not start: see $ROOT$DATA/console.log and $ROOT$DATA/log/"
            sleep 1
        done
    fi
    local deadline=$((SECONDS + 15))
    until valkey_answers; do
        ((SECONDS < deadline)) || die "Valkey did not start: see $ROOT$DATA/valkey/valkey.log"
        sleep 0.5
    done
    say "RabbitMQ 4 ($NODE) on 127.0.0.1:$AMQP_PORT, management $MGMT_PORT, prometheus" \
        "$PROMETHEUS_PORT; Valkey on 127.0.0.1:$VALKEY_PORT"
}

stop() {
    need_root
    [[ -d $ROOT$DATA ]] || {
        say "nothing to stop"
        return
    }
    if ctl -q status >/dev/null 2>&1; then
        # With the pid file, stop returns once the VM has exited.
        # With the pid file, stop returns once the VM has exited.
        TIMEOUT=120 ctl -q stop $DATA/pid >/dev/null 2>&1 || true
    fi
    in_root valkey valkey-cli -p "$VALKEY_PORT" shutdown >/dev/null 2>&1 || true
    epmd_answers && { in_root rabbitmq epmd -port "$EPMD_PORT" -kill >/dev/null 2>&1 || true; }
    local deadline=$((SECONDS + 30))
    while valkey_answers || epmd_answers; do
        ((SECONDS < deadline)) || die "Valkey or epmd on $EPMD_PORT still answers after 30 s"
        sleep 0.5
    done
    say "stopped"
}

status() {
    need_root
    local failed=0
    if ctl -q status >/dev/null 2>&1; then
        say "RabbitMQ $(ctl -q eval 'rabbit_misc:version().' | tr -d '"') ($NODE) on" \
            "127.0.0.1:$AMQP_PORT, management $MGMT_PORT, prometheus $PROMETHEUS_PORT"
    else
        say "RabbitMQ ($NODE) is not running"
        failed=1
    fi
    if valkey_answers; then
        say "Valkey $(in_root valkey valkey-cli -p "$VALKEY_PORT" info server |
            sed -n 's/^valkey_version:\(.*\)\r*$/\1/p' | tr -d '\r') on 127.0.0.1:$VALKEY_PORT"
    else
        say "Valkey is not running on 127.0.0.1:$VALKEY_PORT"
        failed=1
    fi
    return $failed
}

env_lines() {
    echo "export KEYQ_AMQP_URL='amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2F'"
    echo "export KEYQ_REDIS_URL='redis://127.0.0.1:$VALKEY_PORT/0'"
    echo "export KEYQ_MANAGEMENT_URL='http://guest:guest@127.0.0.1:$MGMT_PORT'"
    echo "export KEYQ_PROMETHEUS_URL='http://127.0.0.1:$PROMETHEUS_PORT'"
}

reset() {
    stop
    rm -rf "${ROOT:?}$DATA/mnesia" "${ROOT:?}$DATA/valkey" "${ROOT:?}$DATA/log"
    say "data wiped"
}

case "${1:-}" in
    setup) setup ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) env_lines ;;
    ctl)
        shift
        need_root
        ctl "$@"
        ;;
    reset) reset ;;
    _serve) serve ;;
    -h | --help | help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//' ;;
    *)
        echo "usage: $0 setup|start|stop|status|env|ctl ARGS...|reset" >&2
        exit 2
        ;;
esac
