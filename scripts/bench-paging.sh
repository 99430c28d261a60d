#!/usr/bin/env bash
# Embedded mode with a persistent backlog larger than memory (BENCHMARKS.md, "Storage: paging
# and memory"):
#   1. queue MESSAGES (default 1,000,000) persistent messages of SIZE bytes (default 1024) in
#      a durable queue with confirms, and read the broker's RSS (dlx-bench memory --persistent);
#   2. SIGKILL the broker, start it again on the same directory, and read how long recovery
#      took and the RSS with the backlog restored.
# Needs release binaries: cargo build --release --features bench.
#   scripts/bench-paging.sh [--budget 64MiB] [--fsync never|always]
# BIN (default target/release) picks the binaries; BENCH_OUT the output directory.
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET=64MiB
FSYNC=never
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET="$2"; shift ;;
    --fsync) FSYNC="$2"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
MESSAGES=${MESSAGES:-1000000}
SIZE=${SIZE:-1024}
BIN=${BIN:-$PWD/target/release}
OUT=${BENCH_OUT:-$PWD/target/bench-paging-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/config"

# shellcheck source=scripts/lib.sh
. scripts/lib.sh
PORT=$(free_port)
ADMIN=$(free_port)
# The config has a directory of its own: the broker reloads on any change next to its file.
cat > "$OUT/config/embedded.toml" <<EOF
mode = "embedded"
[listen]
amqp = "127.0.0.1:$PORT"
admin = "127.0.0.1:$ADMIN"
[storage]
dir = "$OUT/data"
fsync = "$FSYNC"
paging_budget = "$BUDGET"
[log]
filter = "warn"
EOF
URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
PID=""
start() {
  "$BIN/dlx-proxy" run --config "$OUT/config/embedded.toml" >> "$OUT/embedded.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 600); do
    if (echo > "/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "the broker did not start; see $OUT/embedded.log" >&2
  exit 1
}
rss_mib() { awk '/VmRSS/ { printf "%.1f", $2 / 1024 }' "/proc/$1/status"; }
metric() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk -v m="dlx_proxy_$1" '$1 == m { print $2 }'; }
trap '[ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true' EXIT

start
"$BIN/dlx-bench" memory --persistent --keep --url "$URL" --pid "$PID" -n "$MESSAGES" \
  --size "$SIZE" --label embedded | tee "$OUT/memory.txt"
echo "paged_messages $(metric storage_paged_messages)"
echo "resident_bytes $(metric storage_resident_bytes)"

kill -9 "$PID"
wait "$PID" 2>/dev/null || true
start
# Recovery is over once its duration is exported; then one period of the memory monitor's
# release of free memory (10 s) before reading the RSS.
for _ in $(seq 1 600); do
  [ -n "$(metric storage_recovery_seconds)" ] && break
  sleep 0.5
done
echo "recovery_seconds $(metric storage_recovery_seconds)"
echo "recovered_messages $(metric storage_recovered_messages)"
echo "rss_after_restart_mib $(rss_mib "$PID")"
sleep 11
echo "rss_after_restart_and_release_mib $(rss_mib "$PID")"
echo "paged_messages_after_restart $(metric storage_paged_messages)"
echo "results in $OUT"
