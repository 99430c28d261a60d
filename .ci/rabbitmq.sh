#!/usr/bin/env bash
# Installs RabbitMQ (CI and the tests need the package: the tests start their own nodes), and
# starts or stops a long-running node for the benchmark scripts (scripts/bench*.sh) on
# 127.0.0.1:5673, with TLS (amqps) on 127.0.0.1:5674.
#   .ci/rabbitmq.sh install   apt-get install rabbitmq-server (Debian's package) and openssl
#   .ci/rabbitmq.sh start     start a node and wait until it accepts AMQP and AMQPS
#   .ci/rabbitmq.sh stop
#
# TLS material: `start` writes a throwaway CA and a server certificate (subjectAltName
# DNS:localhost, IP:127.0.0.1) with openssl into $DLX_RABBITMQ_TLS_DIR (default
# /tmp/dlx-ci-rabbitmq-tls) unless a valid set is already there, plus the rabbitmq.conf that
# opens the TLS listener (no client certificates asked for):
#   ca.pem        the CA to trust (tests read $DLX_RABBITMQ_TLS_DIR/ca.pem)
#   server.pem    server certificate, signed by ca.pem
#   server.key    its key (readable by the rabbitmq user only)
#   rabbitmq.conf listeners.ssl.default and ssl_options; the node gets it as RABBITMQ_CONFIG_FILE
set -euo pipefail
export RABBITMQ_NODENAME=${RABBITMQ_NODENAME:-rabbit@localhost}
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=${RABBITMQ_NODE_PORT:-5673}
export RABBITMQ_DIST_PORT=${RABBITMQ_DIST_PORT:-25673}
export RABBITMQ_LOG_BASE=${RABBITMQ_LOG_BASE:-/tmp/rabbitmq-log}
export RABBITMQ_MNESIA_BASE=${RABBITMQ_MNESIA_BASE:-/tmp/rabbitmq-mnesia}
export RABBITMQ_ENABLED_PLUGINS_FILE=${RABBITMQ_ENABLED_PLUGINS_FILE:-/tmp/rabbitmq-enabled-plugins}
export DLX_RABBITMQ_TLS_DIR=${DLX_RABBITMQ_TLS_DIR:-/tmp/dlx-ci-rabbitmq-tls}
export DLX_RABBITMQ_TLS_PORT=${DLX_RABBITMQ_TLS_PORT:-5674}
export RABBITMQ_CONFIG_FILE="$DLX_RABBITMQ_TLS_DIR/rabbitmq.conf"

# Writes the CA, the server certificate and rabbitmq.conf (the certificates only when they are
# missing or expire within a day: a running node keeps using the files it loaded).
write_tls_files() {
  local dir=$DLX_RABBITMQ_TLS_DIR
  mkdir -p "$dir"
  if ! { [ -s "$dir/ca.pem" ] && [ -s "$dir/server.key" ] &&
         openssl x509 -checkend 86400 -noout -in "$dir/server.pem" >/dev/null 2>&1; }; then
    rm -f "$dir"/ca.pem "$dir"/ca.key "$dir"/server.*
    openssl req -x509 -newkey rsa:2048 -nodes -days 825 -sha256 \
      -subj "/CN=dlx-proxy CI throwaway CA" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
    openssl req -new -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
    printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" \
      "basicConstraints=critical,CA:FALSE" \
      "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=serverAuth" > "$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
      -CAcreateserial -days 825 -sha256 -extfile "$dir/server.ext" \
      -out "$dir/server.pem" 2>/dev/null
    # Nothing else is ever signed with this CA.
    rm -f "$dir/ca.key" "$dir/ca.srl" "$dir/server.csr" "$dir/server.ext"
  fi
  cat > "$dir/rabbitmq.conf" <<CONF
listeners.ssl.default = 127.0.0.1:$DLX_RABBITMQ_TLS_PORT
ssl_options.cacertfile = $dir/ca.pem
ssl_options.certfile = $dir/server.pem
ssl_options.keyfile = $dir/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
CONF
  chmod 755 "$dir"
  chmod 644 "$dir/ca.pem" "$dir/server.pem" "$dir/rabbitmq.conf"
  chmod 600 "$dir/server.key"
  if id rabbitmq >/dev/null 2>&1; then
    chown -R rabbitmq:rabbitmq "$dir"
  fi
}

port_open() {
  (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null
}

case "${1:-}" in
  install)
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
    fi
    if ! command -v openssl >/dev/null 2>&1; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
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
    write_tls_files
    already_running=false
    if rabbitmqctl -q status >/dev/null 2>&1; then
      already_running=true
    else
      rabbitmq-server -detached >/dev/null 2>&1 || true
    fi
    for _ in $(seq 1 120); do
      if port_open "$RABBITMQ_NODE_PORT" && rabbitmqctl -q await_startup >/dev/null 2>&1; then
        # The TLS listener opens with the node; give it a moment, no more.
        for _ in $(seq 1 10); do
          if port_open "$DLX_RABBITMQ_TLS_PORT"; then
            echo "rabbitmq: up on 127.0.0.1:$RABBITMQ_NODE_PORT (amqps on" \
              "127.0.0.1:$DLX_RABBITMQ_TLS_PORT, CA $DLX_RABBITMQ_TLS_DIR/ca.pem)"
            exit 0
          fi
          sleep 1
        done
        if $already_running; then
          echo "rabbitmq: a node without the TLS listener on $DLX_RABBITMQ_TLS_PORT is" \
            "already running; run '$0 stop' and then '$0 start'" >&2
        else
          echo "rabbitmq: no TLS listener on $DLX_RABBITMQ_TLS_PORT; log follows" >&2
          tail -n 50 "$RABBITMQ_LOG_BASE"/*.log >&2 || true
        fi
        exit 1
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
