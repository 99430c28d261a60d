#!/usr/bin/env bash
# Runs every dlx-bench scenario against the embedded broker and against RabbitMQ, side by side,
# and prints one comparison table (see BENCHMARKS.md).
#
#   scripts/bench.sh                 # full run, 2 rounds (about 35 minutes on 2 cores)
#   scripts/bench.sh --quick         # smaller counts, 1 round (a few minutes; numbers are rough)
#   scripts/bench.sh --rounds 3
#
# RabbitMQ: by default a private node is started for the run (Debian's rabbitmq-server must be
# installed, e.g. `sudo bash .ci/rabbitmq.sh install`; needs root to run it as the rabbitmq
# user) with a raised file-descriptor limit, and restarted fresh before each memory scenario,
# so leftovers of other users do not blur its RSS. To use a running RabbitMQ instead, set
# RABBIT_URL (and RABBIT_PID, else the first `pgrep -x beam.smp`); it is then never restarted.
#
# The embedded broker is the release build of this checkout (`cargo build --release --features
# bench`), started on a free port and restarted fresh before each memory scenario.
# Rate scenarios run with both of dlx-bench's clients: lapin (rows marked "lapin") and its own
# raw frame-level client (rows marked "raw"), which costs far less CPU per message, so the
# broker rather than the client limits the rate. ping (one message in flight) uses the raw client.
# Results: BENCH_OUT (default target/bench-<time>/): results.jsonl, logs, table.txt.
# Exit status: 1 if any scenario lost or duplicated a message (or failed), else 0.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=2
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; ROUNDS=1 ;;
    --rounds) ROUNDS="$2"; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$QUICK" = 1 ]; then
  TP_MESSAGES=50000; DL_MESSAGES=30000; BULK_MESSAGES=100000; BULK_TTL_MS=15000
  MEM_MESSAGES=200000; IDLE_CONNECTIONS=1000; PING_MESSAGES=3000
else
  TP_MESSAGES=${TP_MESSAGES:-200000}; DL_MESSAGES=${DL_MESSAGES:-100000}
  BULK_MESSAGES=${BULK_MESSAGES:-1000000}; BULK_TTL_MS=${BULK_TTL_MS:-75000}
  MEM_MESSAGES=${MEM_MESSAGES:-1000000}; IDLE_CONNECTIONS=${IDLE_CONNECTIONS:-1000}
  PING_MESSAGES=${PING_MESSAGES:-10000}
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
OUT=${BENCH_OUT:-$CARGO_TARGET_DIR/bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
FAILED=0

echo "== building (release, feature bench)"
cargo build --release --features bench --bins --quiet
BIN="$CARGO_TARGET_DIR/release"

# shellcheck source=scripts/lib.sh
. scripts/lib.sh

# ---- embedded broker -------------------------------------------------------------------------
EMB_PID=""
EMB_URL=""
start_embedded() {
  local port
  port=$(free_port)
  # The config gets a directory of its own: the broker reloads its config on any change in the
  # config file's directory, and this script writes logs into $OUT.
  mkdir -p "$OUT/embedded-config"
  cat > "$OUT/embedded-config/embedded.toml" <<EOF
mode = "embedded"
[listen]
amqp = "127.0.0.1:$port"
admin = ""
[storage]
# In memory, as the figures in BENCHMARKS.md were taken (storage is on by default).
dir = ""
[log]
filter = "warn"
EOF
  "$BIN/dlx-proxy" run --config "$OUT/embedded-config/embedded.toml" >> "$OUT/embedded.log" 2>&1 &
  EMB_PID=$!
  EMB_URL="amqp://guest:guest@127.0.0.1:$port/%2f"
  wait_port "$port" || { echo "embedded broker did not start; see $OUT/embedded.log" >&2; exit 1; }
  sleep 1
}
stop_embedded() {
  if [ -n "$EMB_PID" ]; then
    kill "$EMB_PID" 2>/dev/null || true
    wait "$EMB_PID" 2>/dev/null || true
    EMB_PID=""
  fi
}

# ---- RabbitMQ ----------------------------------------------------------------------------------
RABBIT_PRIVATE=0
if [ -z "${RABBIT_URL:-}" ]; then
  command -v rabbitmq-server >/dev/null || {
    echo "rabbitmq-server is not installed: sudo bash .ci/rabbitmq.sh install (or set RABBIT_URL)" >&2
    exit 2
  }
  RABBIT_PRIVATE=1
fi
RMQ_NODE="dlxbench$$@localhost"
RMQ_DIR="$OUT/rabbitmq"
rmq_env() {
  env RABBITMQ_NODENAME="$RMQ_NODE" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$RMQ_PORT" RABBITMQ_DIST_PORT="$RMQ_DIST_PORT" \
    RABBITMQ_LOG_BASE="$RMQ_DIR/log" RABBITMQ_MNESIA_BASE="$RMQ_DIR/mnesia" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$RMQ_DIR/enabled_plugins" "$@"
}
RMQ_PID=""
RMQ_URL=""
start_rabbit() {
  if [ "$RABBIT_PRIVATE" = 0 ]; then
    RMQ_URL="$RABBIT_URL"
    RMQ_PID=${RABBIT_PID:-$(pgrep -x beam.smp | head -n 1)}
    return
  fi
  RMQ_PORT=$(free_port)
  RMQ_DIST_PORT=$(free_port)
  rm -rf "$RMQ_DIR"
  mkdir -p "$RMQ_DIR/log" "$RMQ_DIR/mnesia"
  echo "[]." > "$RMQ_DIR/enabled_plugins"
  # Debian's wrapper goes through su, whose PAM limits cut the node to 1024 file descriptors
  # (fewer than 1,000 connections): start the node directly with a raised limit instead.
  chown -R rabbitmq:rabbitmq "$RMQ_DIR"
  (
    ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
    cd /var/lib/rabbitmq
    rmq_env HOME=/var/lib/rabbitmq setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups \
      /usr/lib/rabbitmq/bin/rabbitmq-server -detached
  ) >> "$OUT/rabbitmq-start.log" 2>&1
  for _ in $(seq 1 90); do
    if rmq_env rabbitmqctl -q await_startup >/dev/null 2>&1; then break; fi
    sleep 1
  done
  RMQ_PID=$(rmq_env rabbitmqctl -q eval 'os:getpid().' | tr -d '"')
  RMQ_URL="amqp://guest:guest@127.0.0.1:$RMQ_PORT/%2f"
  wait_port "$RMQ_PORT" || { echo "RabbitMQ did not start; see $RMQ_DIR/log" >&2; exit 1; }
  sleep 2
}
stop_rabbit() {
  if [ "$RABBIT_PRIVATE" = 1 ] && [ -n "$RMQ_PID" ]; then
    rmq_env rabbitmqctl -q stop >/dev/null 2>&1 || true
    for _ in $(seq 1 50); do kill -0 "$RMQ_PID" 2>/dev/null || break; sleep 0.2; done
    RMQ_PID=""
  fi
}

cleanup() {
  stop_embedded
  stop_rabbit
}
trap cleanup EXIT

start_broker() { if [ "$1" = embedded ]; then start_embedded; else start_rabbit; fi; }
stop_broker() { if [ "$1" = embedded ]; then stop_embedded; else stop_rabbit; fi; }
broker_url() { if [ "$1" = embedded ]; then echo "$EMB_URL"; else echo "$RMQ_URL"; fi; }
broker_pid() { if [ "$1" = embedded ]; then echo "$EMB_PID"; else echo "$RMQ_PID"; fi; }

# bench ROUND BROKER CASE ARGS...: one dlx-bench run against BROKER (scripts/lib.sh).
bench() {
  local round=$1 broker=$2 case=$3
  shift 3
  bench_run "$round" "$broker" "$case" "$(broker_url "$broker")" "$(broker_pid "$broker")" "$@"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cores: $(nproc)  memory: $(free -h | awk '/Mem:/ {print $2}')  kernel: $(uname -r)"
  echo "rustc: $(rustc --version)"
  echo "rabbitmq-server: $(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo '?')  erlang: $(dpkg-query -W -f='${Version}' erlang-base 2>/dev/null || echo '?')"
  echo "rabbitmq: $([ "$RABBIT_PRIVATE" = 1 ] && echo "private node per run" || echo "existing node $RABBIT_URL")"
  echo "rounds: $ROUNDS  quick: $QUICK"
} | tee "$OUT/conditions.txt"

for round in $(seq 1 "$ROUNDS"); do
  for broker in embedded rabbitmq; do
    # Memory scenarios start from a fresh broker each.
    start_broker "$broker"
    bench "$round" "$broker" idle idle-connections --count 0 --hold-seconds 2
    bench "$round" "$broker" connections idle-connections --count "$IDLE_CONNECTIONS" --hold-seconds 5
    stop_broker "$broker"

    start_broker "$broker"
    bench "$round" "$broker" memory memory -n "$MEM_MESSAGES"
    stop_broker "$broker"

    start_broker "$broker"
    bench "$round" "$broker" expire-bulk expire-bulk -n "$BULK_MESSAGES" --ttl-ms "$BULK_TTL_MS"
    stop_broker "$broker"

    start_broker "$broker"
    bench "$round" "$broker" expire-bulk-dlq expire-bulk --into-dlq -n "$BULK_MESSAGES" --ttl-ms "$BULK_TTL_MS"
    stop_broker "$broker"

    # Rates: one broker instance for all of them.
    start_broker "$broker"
    # One message in flight: round-trip latency without pipelining (raw client).
    bench "$round" "$broker" ping ping --confirms off -n "$PING_MESSAGES"
    bench "$round" "$broker" ping-confirms ping --confirms on -n "$PING_MESSAGES"
    for client in lapin raw; do
      # Case names: lapin rows keep their historical names, raw rows end in -raw.
      sfx=""; [ "$client" = raw ] && sfx="-raw"
      bench "$round" "$broker" "tp-confirms$sfx" throughput --client "$client" --confirms on -n "$TP_MESSAGES"
      bench "$round" "$broker" "tp-noconfirms$sfx" throughput --client "$client" --confirms off -n "$TP_MESSAGES"
      for kind in reject expiry overflow; do
        bench "$round" "$broker" "dl-$kind$sfx" deadletter --client "$client" --kind "$kind" -n "$DL_MESSAGES"
      done
      # The same with the DLQ consumer acking in batches (less client work per message).
      for kind in reject expiry overflow; do
        bench "$round" "$broker" "dl-$kind$sfx-batch" deadletter --client "$client" --kind "$kind" -n "$DL_MESSAGES" --ack-every 100
      done
    done
    stop_broker "$broker"
  done
done

echo
python3 - "$RESULTS" <<'PY' | tee "$OUT/table.txt"
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def runs(broker, case, key):
    return [r[key] for r in rows if r.get("broker") == broker and r.get("case") == case
            and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
def med(v):
    return statistics.median(v) if v else None
def fmt(x):
    if x is None: return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"
def cell(broker, case, key):
    v = runs(broker, case, key)
    if not v: return "-", None
    m = med(v)
    shown = fmt(m) if len(v) == 1 else f"{fmt(m)} ({' / '.join(fmt(x) for x in v)})"
    return shown, m

# Case suffix and row label of each client (lapin rows keep their historical case names).
CLIENTS = (("", "lapin"), ("-raw", "raw"))
table = []
for case, what in (("ping", "confirms off"), ("ping-confirms", "confirms on")):
    table += [
        (f"ping 1 in flight, 100 B, {what} (raw): round trip p50 (us)", case, "rtt_p50_us", "lower"),
        ("  round trip p90 (us)", case, "rtt_p90_us", "lower"),
        ("  round trip p99 (us)", case, "rtt_p99_us", "lower"),
        ("  round trips/s", case, "rate_msg_s", "higher"),
        ("  broker CPU per round trip (us)", case, "broker_cpu_us_per_msg", "lower"),
    ]
for sfx, client in CLIENTS:
    for case, what in ((f"tp-confirms{sfx}", "confirms on"), (f"tp-noconfirms{sfx}", "confirms off")):
        table += [
            (f"throughput 1P/1C 100 B, {what} ({client}): msg/s", case, "rate_msg_s", "higher"),
            ("  latency p50 (us)", case, "latency_p50_us", "lower"),
            ("  latency p99 (us)", case, "latency_p99_us", "lower"),
            ("  broker CPU per message (us)", case, "broker_cpu_us_per_msg", "lower"),
        ]
for sfx, client in CLIENTS:
    for kind in ("reject", "expiry", "overflow"):
        table += [
            (f"dead-letter {kind} ({client}): msg/s into the DLQ", f"dl-{kind}{sfx}", "dead_letter_rate_msg_s", "higher"),
            ("  publish-to-DLQ p50 (us)", f"dl-{kind}{sfx}", "latency_p50_us", "lower"),
            ("  publish-to-DLQ p99 (us)", f"dl-{kind}{sfx}", "latency_p99_us", "lower"),
            ("  broker CPU per message (us)", f"dl-{kind}{sfx}", "broker_cpu_us_per_msg", "lower"),
        ]
for sfx, client in CLIENTS:
    for kind in ("reject", "expiry", "overflow"):
        table += [
            (f"dead-letter {kind}, DLQ acked per 100 ({client}): msg/s", f"dl-{kind}{sfx}-batch", "dead_letter_rate_msg_s", "higher"),
            ("  broker CPU per message (us)", f"dl-{kind}{sfx}-batch", "broker_cpu_us_per_msg", "lower"),
        ]
for sfx, client in CLIENTS:
    table += [
        (f"benchmark client CPU, throughput with confirms ({client}) (s)", f"tp-confirms{sfx}", "bench_cpu_s", "lower"),
        (f"broker CPU, throughput with confirms ({client}) (s)", f"tp-confirms{sfx}", "broker_cpu_s", "lower"),
        (f"benchmark client CPU, dead-letter reject ({client}) (s)", f"dl-reject{sfx}", "bench_cpu_s", "lower"),
        (f"broker CPU, dead-letter reject ({client}) (s)", f"dl-reject{sfx}", "broker_cpu_s", "lower"),
    ]
for case, what in (("expire-bulk", "dropped"), ("expire-bulk-dlq", "into a DLQ")):
    table += [
        (f"bulk expiry ({what}): s until empty after the last is due", case, "empty_after_last_due_secs", "lower"),
        ("  expiry rate while due (msg/s)", case, "expiry_rate_msg_s", "higher"),
        ("  RSS before fill (MiB)", case, "rss_before_mib", "lower"),
        ("  RSS full (MiB)", case, "rss_peak_mib", "lower"),
        ("  RSS after expiry (MiB)", case, "rss_after_mib", "lower"),
    ]
table += [
    ("idle broker RSS (MiB)", "idle", "rss_before_mib", "lower"),
    ("RSS with 1,000 idle connections + channels (MiB)", "connections", "rss_with_connections_mib", "lower"),
    ("  per connection (KiB)", "connections", "rss_per_connection_kib", "lower"),
    ("queued 100 B messages: RSS bytes per message", "memory", "rss_bytes_per_msg", "lower"),
    ("  overhead per message beyond the body (bytes)", "memory", "overhead_bytes_per_msg", "lower"),
]

w = max(len(t[0]) for t in table)
print(f"{'metric':<{w}}  {'RabbitMQ':>24}  {'embedded':>24}  ratio")
print("-" * (w + 62))
for label, case, key, better in table:
    r_s, r = cell("rabbitmq", case, key)
    e_s, e = cell("embedded", case, key)
    ratio = "-"
    if r and e:
        ratio = f"{e / r:.2f}x" if better == "higher" else f"{r / e:.2f}x less"
    print(f"{label:<{w}}  {r_s:>24}  {e_s:>24}  {ratio}")
print("(median of rounds; each round in parentheses. ratio: embedded / RabbitMQ for rates,")
print(" RabbitMQ / embedded for costs.)")

def ratio(case, key):
    r, e = med(runs("rabbitmq", case, key)), med(runs("embedded", case, key))
    return e / r if r and e else None
def emb(case, key):
    return med(runs("embedded", case, key))
def show(ok):
    return "n/a" if ok is None else ("MET" if ok else "MISSED")
print()
print("targets (embedded broker):")
targets = []
for sfx, client in CLIENTS:
    for case, name in ((f"tp-confirms{sfx}", "with confirms"), (f"tp-noconfirms{sfx}", "without confirms")):
        x = ratio(case, "rate_msg_s")
        targets.append((f">= 2x RabbitMQ msg/s at 1P/1C, 100 B, {name} ({client})", x and x >= 2, f"{x:.2f}x" if x else "-"))
x = emb("idle", "rss_before_mib")
targets.append(("idle RSS <= 15 MiB", x is not None and x <= 15 if x is not None else None, f"{x:.1f} MiB" if x else "-"))
x = emb("connections", "rss_with_connections_mib")
targets.append(("1,000 connections with a channel each <= 100 MiB RSS", x <= 100 if x is not None else None, f"{x:.1f} MiB" if x else "-"))
for sfx, client in CLIENTS:
    for kind in ("reject", "expiry", "overflow"):
        x = ratio(f"dl-{kind}{sfx}", "dead_letter_rate_msg_s")
        targets.append((f">= 3x RabbitMQ dead-letter rate ({kind}, {client})", x and x >= 3, f"{x:.2f}x" if x else "-"))
bulk = [r for r in rows if r.get("broker") == "embedded" and r.get("case") == "expire-bulk"]
if bulk:
    ok = all(r.get("ok") and r.get("peak_depth") == r.get("published") for r in bulk)
    lag = med(runs("embedded", "expire-bulk", "empty_after_last_due_secs"))
    targets.append((f"expiry of {bulk[0].get('published', 0):,} queued messages (one broker timer, no task per message)",
                    ok, f"empty {lag:.2f} s after the last was due" if lag is not None else "did not drain"))
x = emb("memory", "overhead_bytes_per_msg")
targets.append(("<= 200 bytes overhead per queued 100-byte message", x <= 200 if x is not None else None, f"{x:.0f} B" if x is not None else "-"))
for name, ok, val in targets:
    print(f"  {show(ok):<7} {name}: {val}")
bad = [r for r in rows if not r.get("ok", False)]
print()
if bad:
    print("FAILED runs (loss, duplicates or errors):")
    for r in bad:
        print(f"  round {r.get('round')} {r.get('broker')} {r.get('case')}: {'; '.join(r.get('failures', [])) or 'exit ' + str(r.get('exit'))}")
else:
    print("every run delivered or dead-lettered each message exactly once")
PY

echo "results: $OUT"
exit "$FAILED"
