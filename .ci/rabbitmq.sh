#!/usr/bin/env bash
# Starts or stops the reference RabbitMQ used by proxy-mode and differential tests.
# It listens on 127.0.0.1:5673 so it never collides with dlx-proxy's own 5672.
#   .ci/rabbitmq.sh install   apt-get install rabbitmq-server (Debian's package)
#   .ci/rabbitmq.sh start     start a node and wait until it accepts AMQP
#   .ci/rabbitmq.sh stop
set -euo pipefail
export RABBITMQ_NODENAME=${RABBITMQ_NODENAME:-rabbit@localhost}
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=${RABBITMQ_NODE_PORT:-5673}
export RABBITMQ_DIST_PORT=${RABBITMQ_DIST_PORT:-25673}
export RABBITMQ_LOG_BASE=${RABBITMQ_LOG_BASE:-/tmp/rabbitmq-log}
export RABBITMQ_MNESIA_BASE=${RABBITMQ_MNESIA_BASE:-/tmp/rabbitmq-mnesia}
export RABBITMQ_ENABLED_PLUGINS_FILE=${RABBITMQ_ENABLED_PLUGINS_FILE:-/tmp/rabbitmq-enabled-plugins}

case "${1:-}" in
  install)
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
    fi
    # Debian starts the packaged service where it can; ours runs on its own port.
    (service rabbitmq-server stop || true) >/dev/null 2>&1
    ;;
  start)
    mkdir -p "$RABBITMQ_LOG_BASE" "$RABBITMQ_MNESIA_BASE"
    echo "[]." > "$RABBITMQ_ENABLED_PLUGINS_FILE"
    # Debian's wrapper runs the node as the rabbitmq user.
    if id rabbitmq >/dev/null 2>&1; then
      chown -R rabbitmq:rabbitmq "$RABBITMQ_LOG_BASE" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_ENABLED_PLUGINS_FILE"
    fi
    if ! rabbitmqctl -q status >/dev/null 2>&1; then
      rabbitmq-server -detached >/dev/null 2>&1 || true
    fi
    for _ in $(seq 1 120); do
      if (echo > /dev/tcp/127.0.0.1/"$RABBITMQ_NODE_PORT") 2>/dev/null && \
         rabbitmqctl -q await_startup >/dev/null 2>&1; then
        echo "rabbitmq: up on 127.0.0.1:$RABBITMQ_NODE_PORT"
        exit 0
      fi
      sleep 1
    done
    echo "rabbitmq: did not start; log follows" >&2
    tail -n 50 "$RABBITMQ_LOG_BASE"/*.log >&2 || true
    exit 1
    ;;
  stop)
    rabbitmqctl -q stop >/dev/null 2>&1 || true
    ;;
  ctl)
    shift
    exec rabbitmqctl "$@"
    ;;
  *)
    echo "usage: $0 install|start|stop|ctl ARGS" >&2
    exit 2
    ;;
esac
