#!/usr/bin/env bash
# RabbitMQ nodes of one's own for the benchmarks, under a directory of their own (no system
# service, no system config): one node, or a cluster of N nodes on this machine.
#
#   scripts/rabbit-local.sh start DIR [N]   # N nodes (default 1), clustered when N > 1
#   scripts/rabbit-local.sh stop DIR        # stops every node started under DIR
#
# `start` writes DIR/env, to be sourced: RABBIT_URL (node 1, guest/guest, vhost /),
# RABBIT_URLS (every node, space-separated), RABBIT_UPSTREAMS (amqp://127.0.0.1:PORT of each
# node, comma-separated in TOML-string form for upstream.urls), RABBIT_PID (node 1's
# beam.smp) and RABBIT_PIDS (every node's), RABBITMQCTL (a wrapper bound to node 1).
# guest may log in from 127.0.0.1 (the default loopback_users), which is all the benchmarks use.
# Facts behind the cluster set-up: shared/notes (one cookie, per-node ports and directories,
# join_cluster after await_startup).
set -euo pipefail

BIN=${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
cmd=${1:-}
DIR=${2:-}
if [ -z "$cmd" ] || [ -z "$DIR" ]; then
  sed -n '2,13p' "$0"
  exit 2
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

node_env() {
  local i=$1
  export HOME="$DIR/home"
  export RABBITMQ_NODENAME="bench$i-$$@localhost"
  if [ -f "$DIR/n$i/name" ]; then RABBITMQ_NODENAME=$(cat "$DIR/n$i/name"); fi
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_MNESIA_BASE="$DIR/n$i/mnesia"
  export RABBITMQ_LOG_BASE="$DIR/n$i/log"
  export RABBITMQ_PID_FILE="$DIR/n$i/pid"
  export RABBITMQ_CONFIG_FILE="$DIR/n$i/rabbitmq.conf"
  export RABBITMQ_CONF_ENV_FILE="$DIR/n$i/rabbitmq-env.conf"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/n$i/enabled_plugins"
}

case "$cmd" in
  start)
    N=${3:-1}
    mkdir -p "$DIR/home"
    DIR=$(cd "$DIR" && pwd)
    if [ ! -f "$DIR/home/.erlang.cookie" ]; then
      echo "BENCHCOOKIE$$" > "$DIR/home/.erlang.cookie"
      chmod 400 "$DIR/home/.erlang.cookie"
    fi
    ulimit -n 65536 2>/dev/null || true
    urls=() upstreams=() pids=()
    for i in $(seq 1 "$N"); do
      mkdir -p "$DIR/n$i/mnesia" "$DIR/n$i/log"
      echo "bench$i-$$@localhost" > "$DIR/n$i/name"
      port=$(free_port)
      echo "$port" > "$DIR/n$i/port"
      : > "$DIR/n$i/rabbitmq.conf"
      : > "$DIR/n$i/rabbitmq-env.conf"
      echo "[]." > "$DIR/n$i/enabled_plugins"
      (
        node_env "$i"
        export RABBITMQ_NODE_PORT=$port
        export RABBITMQ_DIST_PORT=$(free_port)
        nohup "$BIN/rabbitmq-server" > "$DIR/n$i/server.out" 2>&1 &
      )
    done
    for i in $(seq 1 "$N"); do
      # `wait` polls until the pid file and the node are there (await_startup fails at once
      # while the node is not reachable yet).
      ( node_env "$i"; "$BIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" -q wait "$RABBITMQ_PID_FILE" --timeout 120 )
    done
    first=$(cat "$DIR/n1/name")
    for i in $(seq 2 "$N"); do
      (
        node_env "$i"
        ctl() { "$BIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" -q "$@"; }
        ctl stop_app
        ctl join_cluster "$first"
        ctl start_app
      )
    done
    for i in $(seq 1 "$N"); do
      port=$(cat "$DIR/n$i/port")
      urls+=("amqp://guest:guest@127.0.0.1:$port/%2f")
      upstreams+=("\"amqp://127.0.0.1:$port\"")
      pids+=("$(cat "$DIR/n$i/pid")")
    done
    cat > "$DIR/rabbitmqctl" <<EOF
#!/bin/sh
HOME='$DIR/home' exec '$BIN/rabbitmqctl' -n '$first' "\$@"
EOF
    chmod +x "$DIR/rabbitmqctl"
    {
      echo "RABBIT_URL='${urls[0]}'"
      echo "RABBIT_URLS='${urls[*]}'"
      echo "RABBIT_UPSTREAMS='$(IFS=,; echo "${upstreams[*]}")'"
      echo "RABBIT_PID='${pids[0]}'"
      echo "RABBIT_PIDS='${pids[*]}'"
      echo "RABBITMQCTL='$DIR/rabbitmqctl'"
    } > "$DIR/env"
    echo "started $N node(s); source $DIR/env"
    ;;
  stop)
    DIR=$(cd "$DIR" && pwd)
    for d in "$DIR"/n*; do
      [ -f "$d/name" ] || continue
      i=${d##*/n}
      (
        node_env "$i"
        "$BIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" -q stop > /dev/null 2>&1 \
          || kill -9 "$(cat "$RABBITMQ_PID_FILE")" 2> /dev/null || true
      )
    done
    ;;
  *)
    echo "unknown command: $cmd" >&2
    exit 2
    ;;
esac
