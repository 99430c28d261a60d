#!/usr/bin/env bash
# Storage benchmark (issue 13), one run side by side: persistent 1 producer / 1 consumer with
# confirms (durable queue, delivery_mode 2) at 100 B and 4 KiB into RabbitMQ's durable classic
# queue, RabbitMQ's quorum queue and the embedded broker with storage.fsync = "always"; then
# the embedded broker's recovery of 1 M persistent 1 KiB messages after a SIGKILL (time until
# /readyz answers 200, and the storage_recovery_seconds metric) with every message
# consumed and checked afterwards; then transient throughput (non-durable queue, 100 B) of the
# embedded broker with storage off and on, to compare with the figures in BENCHMARKS.md.
#
#   scripts/bench-storage.sh                 # 2 rounds
#   scripts/bench-storage.sh --rounds 1 --quick
#
# RabbitMQ: set RABBIT_URL and RABBIT_PID (e.g. `scripts/rabbit-local.sh start /tmp/r 1 &&
# . /tmp/r/env && export RABBIT_URL RABBIT_PID`); else a node is started with
# scripts/rabbit-local.sh under the output directory and stopped at the end.
# The embedded broker: the release build of this checkout, a fresh storage directory per case.
# Results: BENCH_OUT (default target/bench-storage-<time>/): results.jsonl, logs, table.txt.
# Exit status: 1 if any run lost or duplicated a message (or failed), else 0.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=2
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --rounds) ROUNDS="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$QUICK" = 1 ]; then
  P_MESSAGES=${P_MESSAGES:-20000}; RECOVERY_MESSAGES=${RECOVERY_MESSAGES:-200000}; TP_MESSAGES=${TP_MESSAGES:-50000}
else
  P_MESSAGES=${P_MESSAGES:-100000}; RECOVERY_MESSAGES=${RECOVERY_MESSAGES:-1000000}; TP_MESSAGES=${TP_MESSAGES:-200000}
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
OUT=${BENCH_OUT:-$CARGO_TARGET_DIR/bench-storage-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
FAILED=0

echo "== building (release, feature bench)"
cargo build --release --features bench --bins --quiet
BIN="$CARGO_TARGET_DIR/release"

# shellcheck source=scripts/lib.sh
. scripts/lib.sh

# ---- embedded broker -------------------------------------------------------------------------
EMB_PID="" EMB_URL="" EMB_PORT="" EMB_ADMIN=""
# start_embedded STORAGE_DIR: "" = storage off. The config lives in a directory of its own
# (the broker reloads on changes in its config file's directory).
start_embedded() {
  local dir=$1
  EMB_PORT=${EMB_PORT:-$(free_port)}
  EMB_ADMIN=${EMB_ADMIN:-$(free_port)}
  mkdir -p "$OUT/embedded-config"
  cat > "$OUT/embedded-config/embedded.toml" <<TOML
mode = "embedded"
[listen]
amqp = "127.0.0.1:$EMB_PORT"
admin = "127.0.0.1:$EMB_ADMIN"
[storage]
dir = "$dir"
fsync = "always"
[log]
filter = "warn"
TOML
  EMB_STARTED=$(date +%s.%N)
  "$BIN/dlx-proxy" run --config "$OUT/embedded-config/embedded.toml" >> "$OUT/embedded.log" 2>&1 &
  EMB_PID=$!
  EMB_URL="amqp://guest:guest@127.0.0.1:$EMB_PORT/%2f"
  # Ready = /readyz answers 200: the listeners are bound before recovery, and connections
  # wait until the stored state is loaded.
  for _ in $(seq 1 6000); do
    if curl -sf -o /dev/null "http://127.0.0.1:$EMB_ADMIN/readyz"; then
      EMB_READY=$(date +%s.%N)
      return 0
    fi
    kill -0 "$EMB_PID" 2>/dev/null || break
    sleep 0.01
  done
  echo "embedded broker did not start; see $OUT/embedded.log" >&2
  exit 1
}
stop_embedded() {
  if [ -n "$EMB_PID" ]; then
    kill "${1:--TERM}" "$EMB_PID" 2>/dev/null || true
    wait "$EMB_PID" 2>/dev/null || true
    EMB_PID=""
  fi
}
# CPU seconds (user + system) the process PID has used.
cpu_secs() {
  python3 -c 'import os,sys; f=open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")",1)[1].split(); print((int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK"))' "$1"
}
metric() {
  curl -s "http://127.0.0.1:$EMB_ADMIN/metrics" | awk -v m="$1" '$1 == m {print $2}'
}

# ---- RabbitMQ ----------------------------------------------------------------------------------
RABBIT_OWN=""
if [ -z "${RABBIT_URL:-}" ]; then
  RABBIT_OWN="$OUT/rabbit"
  scripts/rabbit-local.sh start "$RABBIT_OWN" 1 > "$OUT/rabbit-start.log" 2>&1
  # shellcheck disable=SC1091
  . "$RABBIT_OWN/env"
fi
RMQ_URL=$RABBIT_URL
RMQ_PID=${RABBIT_PID:-$(pgrep -x beam.smp | head -n 1)}

cleanup() {
  stop_embedded
  if [ -n "$RABBIT_OWN" ]; then scripts/rabbit-local.sh stop "$RABBIT_OWN" > /dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# bench ROUND BROKER CASE URL PID ARGS...: one dlx-bench run (scripts/lib.sh).
bench() { bench_run "$@"; }
# extra ROUND BROKER CASE KEY VALUE: one more measured value (not from dlx-bench).
extra() {
  echo "{\"round\": $1, \"broker\": \"$2\", \"case\": \"$3\", \"$4\": $5, \"ok\": true}" >> "$RESULTS"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cores: $(nproc)  memory: $(free -h | awk '/Mem:/ {print $2}')  kernel: $(uname -r)"
  echo "storage dir file system: $(df -hT "$OUT" | awk 'NR==2 {print $2, $1}')"
  echo "rabbitmq: $RMQ_URL (pid $RMQ_PID)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/conditions.txt"

PERSISTENT=(throughput --client raw --confirms on --persistent -n "$P_MESSAGES")
for round in $(seq 1 "$ROUNDS"); do
  for size in 100 4096; do
    bench "$round" rabbitmq "p-classic-$size" "$RMQ_URL" "$RMQ_PID" "${PERSISTENT[@]}" --queue-type classic --size "$size"
    bench "$round" rabbitmq "p-quorum-$size" "$RMQ_URL" "$RMQ_PID" "${PERSISTENT[@]}" --queue-type quorum --size "$size"
    rm -rf "$OUT/data"
    start_embedded "$OUT/data"
    bench "$round" embedded "p-classic-$size" "$EMB_URL" "$EMB_PID" "${PERSISTENT[@]}" --queue-type classic --size "$size"
    extra "$round" embedded "p-classic-$size" fsyncs "$(metric dlx_proxy_storage_fsync_seconds_count)"
    stop_embedded
  done

  # Recovery: fill, SIGKILL, restart, time until ready, then consume and check all.
  rm -rf "$OUT/data"
  start_embedded "$OUT/data"
  bench "$round" embedded recovery-fill "$EMB_URL" "$EMB_PID" fill --client raw --queue-type classic \
    --persistent --size 1024 -n "$RECOVERY_MESSAGES"
  du -sb "$OUT/data" | awk '{print "   on disk: " $1 " bytes"}'
  stop_embedded -KILL
  start_embedded "$OUT/data"
  ready=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$EMB_STARTED" "$EMB_READY")
  cpu=$(cpu_secs "$EMB_PID")
  echo "   restart: ready after $ready s; storage_recovery_seconds $(metric dlx_proxy_storage_recovery_seconds); CPU until then $cpu s; recovered $(metric dlx_proxy_storage_recovered_messages)"
  extra "$round" embedded recovery start_to_ready_secs "$ready"
  extra "$round" embedded recovery start_cpu_secs "$cpu"
  extra "$round" embedded recovery recovery_secs "$(metric dlx_proxy_storage_recovery_seconds)"
  extra "$round" embedded recovery recovered_messages "$(metric dlx_proxy_storage_recovered_messages)"
  bench "$round" embedded recovery-drain "$EMB_URL" "$EMB_PID" drain --client raw --queue-type classic \
    --size 1024 -n "$RECOVERY_MESSAGES" --idle-timeout 60
  stop_embedded
  rm -rf "$OUT/data"

  # Transient throughput (non-durable queue, 100 B, raw client), storage off and on.
  start_embedded ""
  bench "$round" embedded tp-storage-off "$EMB_URL" "$EMB_PID" throughput --client raw --confirms on -n "$TP_MESSAGES"
  stop_embedded
  start_embedded "$OUT/data"
  bench "$round" embedded tp-storage-on "$EMB_URL" "$EMB_PID" throughput --client raw --confirms on -n "$TP_MESSAGES"
  stop_embedded
  rm -rf "$OUT/data"
done

echo
python3 - "$RESULTS" <<'PY' | tee "$OUT/table.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def runs(broker, case, key):
    return [r[key] for r in rows if r.get("broker") == broker and r.get("case") == case
            and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
def med(v): return statistics.median(v) if v else None
def fmt(x):
    if x is None: return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"
def cell(broker, case, key):
    v = runs(broker, case, key)
    if not v: return "-"
    return fmt(med(v)) if len(v) == 1 else f"{fmt(med(v))} ({' / '.join(fmt(x) for x in v)})"
print(f"{'persistent 1P/1C, confirms, raw client: msg/s':<48} {'RabbitMQ classic':>22} {'RabbitMQ quorum':>22} {'embedded fsync=always':>22}")
for size in (100, 4096):
    c = f"p-classic-{size}"; q = f"p-quorum-{size}"
    print(f"{f'  {size} B: msg/s':<48} {cell('rabbitmq', c, 'rate_msg_s'):>22} {cell('rabbitmq', q, 'rate_msg_s'):>22} {cell('embedded', c, 'rate_msg_s'):>22}")
    print(f"{'    latency p50 (us)':<48} {cell('rabbitmq', c, 'latency_p50_us'):>22} {cell('rabbitmq', q, 'latency_p50_us'):>22} {cell('embedded', c, 'latency_p50_us'):>22}")
    print(f"{'    latency p99 (us)':<48} {cell('rabbitmq', c, 'latency_p99_us'):>22} {cell('rabbitmq', q, 'latency_p99_us'):>22} {cell('embedded', c, 'latency_p99_us'):>22}")
    print(f"{'    broker CPU per message (us)':<48} {cell('rabbitmq', c, 'broker_cpu_us_per_msg'):>22} {cell('rabbitmq', q, 'broker_cpu_us_per_msg'):>22} {cell('embedded', c, 'broker_cpu_us_per_msg'):>22}")
    print(f"{'    embedded fsyncs in the run':<48} {'':>22} {'':>22} {cell('embedded', c, 'fsyncs'):>22}")
print()
print(f"recovery of {fmt(med(runs('embedded', 'recovery-fill', 'published')))} persistent 1 KiB messages after SIGKILL:")
print(f"  fill rate (msg/s, confirms):           {cell('embedded', 'recovery-fill', 'publish_rate_msg_s')}")
print(f"  start to /readyz 200 (s):              {cell('embedded', 'recovery', 'start_to_ready_secs')}")
print(f"  storage_recovery_seconds:              {cell('embedded', 'recovery', 'recovery_secs')}")
print(f"  broker CPU from start to ready (s):     {cell('embedded', 'recovery', 'start_cpu_secs')}")
print(f"  recovered messages:                    {cell('embedded', 'recovery', 'recovered_messages')}")
print(f"  drained, each exactly once:            {cell('embedded', 'recovery-drain', 'distinct')}")
print()
print("transient throughput, non-durable queue, 100 B, confirms, raw client (msg/s):")
print(f"  storage off: {cell('embedded', 'tp-storage-off', 'rate_msg_s')}   storage on: {cell('embedded', 'tp-storage-on', 'rate_msg_s')}")
print()
def ratio(size):
    r, e = med(runs("rabbitmq", f"p-classic-{size}", "rate_msg_s")), med(runs("embedded", f"p-classic-{size}", "rate_msg_s"))
    return e / r if r and e else None
print("targets (embedded broker):")
for size in (100, 4096):
    x = ratio(size)
    print(f"  {'n/a' if x is None else ('MET' if x >= 3 else 'MISSED'):<7} >= 3x RabbitMQ durable classic msg/s, persistent {size} B: {'-' if x is None else f'{x:.2f}x'}")
rec = med(runs("embedded", "recovery", "start_to_ready_secs"))
print(f"  {'n/a' if rec is None else ('MET' if rec <= 5 else 'MISSED'):<7} recovery of the persistent messages <= 5 s: {'-' if rec is None else f'{rec:.2f} s to ready'}")
off, on = med(runs("embedded", "tp-storage-off", "rate_msg_s")), med(runs("embedded", "tp-storage-on", "rate_msg_s"))
if off and on:
    print(f"  {'MET' if on >= 0.95 * off else 'MISSED':<7} transient throughput with storage on within 5 % of storage off: {on / off:.2f}")
bad = [r for r in rows if not r.get("ok", False)]
print()
if bad:
    print("FAILED runs:")
    for r in bad:
        print(f"  round {r.get('round')} {r.get('broker')} {r.get('case')}: {'; '.join(r.get('failures', [])) or 'exit ' + str(r.get('exit'))}")
else:
    print("every run delivered each message exactly once")
PY
echo "results: $OUT"
exit "$FAILED"
