#!/usr/bin/env bash
# Memory returned to the OS after a queue holding ~1 GiB is deleted (BENCHMARKS.md, "Memory
# after queues are emptied"): `dlx-bench memory` against the embedded broker with
#   glibc          - malloc_trim replaced by a no-op (a preloaded shim built with cc);
#   glibc+trim     - the default: malloc_trim when due (every 10 s after growth);
#   jemalloc       - libjemalloc.so.2 preloaded (Debian's libjemalloc2), its defaults;
#   jemalloc+bg    - the same with background_thread:true (decay without allocator activity).
# Usage: scripts/bench-memory.sh [MESSAGES] [SIZE]   (default 1000000 x 1024 bytes); SETTLE
# (seconds before each RSS reading, default 15) in the environment.
# Needs: cargo build --release --features bench; apt-get install libjemalloc2 for the last two.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000000}
SIZE=${2:-1024}
BIN=target/release
JEMALLOC=${JEMALLOC:-/usr/lib/x86_64-linux-gnu/libjemalloc.so.2}
SETTLE=${SETTLE:-15}
OUT=$(mktemp -d /tmp/dlx-bench-memory.XXXXXX)
echo 'int malloc_trim(unsigned long pad) { (void)pad; return 0; }' > "$OUT/notrim.c"
cc -shared -fPIC -o "$OUT/notrim.so" "$OUT/notrim.c"
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
run() {
  local label=$1 preload=$2 conf=$3 port pid
  port=$(free_port)
  mkdir -p "$OUT/$label"
  cat > "$OUT/$label/config.toml" <<CONF
mode = "embedded"
[listen]
amqp = "127.0.0.1:$port"
admin = ""
[storage]
# In memory, as the figures in BENCHMARKS.md were taken (storage is on by default).
dir = ""
[limits]
memory_high_watermark = "20GiB"
[log]
filter = "warn,dlx_proxy::memory=debug"
CONF
  env ${preload:+LD_PRELOAD=$preload} ${conf:+MALLOC_CONF=$conf} \
    "$BIN/dlx-proxy" run --config "$OUT/$label/config.toml" > "$OUT/$label/broker.log" 2>&1 &
  pid=$!
  wait_port "$port" || { echo "broker did not start: $OUT/$label/broker.log" >&2; exit 1; }
  sleep 1
  echo "== $label"
  "$BIN/dlx-bench" memory --url "amqp://guest:guest@127.0.0.1:$port/%2f" -n "$N" --size "$SIZE" \
    --client raw --settle-seconds "$SETTLE" --pid "$pid" --label "$label" | tee "$OUT/$label/report.txt"
  grep -h "handed back" "$OUT/$label/broker.log" | tail -3 || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
run glibc "$OUT/notrim.so" ""
run glibc+trim "" ""
if [ -e "$JEMALLOC" ]; then
  run jemalloc "$JEMALLOC" ""
  run jemalloc+bg "$JEMALLOC" "background_thread:true"
fi
echo "reports and logs in $OUT"
