#!/usr/bin/env bash
# Proxy mode against RabbitMQ directly and against HAProxy in TCP mode (the plain forwarder a
# user would otherwise deploy), side by side in one run (see BENCHMARKS.md, "Proxy mode"):
# throughput (1 producer / 1 consumer, 100 B and 4 KiB, confirms off and on, lapin and raw
# clients) and single-message round trips (ping), with the CPU time per message of each path
# (RabbitMQ's for direct, the forwarder's otherwise) and the ratios proxy / HAProxy.
# HAProxy (Debian package `haproxy`) is installed with apt-get when absent.
#
#   scripts/bench-proxy.sh                 # everything shares the machine's cores
#   scripts/bench-proxy.sh --pinned        # proxy on core 1; RabbitMQ and the client on core 0
#   scripts/bench-proxy.sh --rounds 3 -n 100000
#   scripts/bench-proxy.sh --worker-threads 1   # the proxy's runtime.worker_threads (0 = per core)
#   scripts/bench-proxy.sh --busy-poll 200      # the proxy's proxy.busy_poll_us (0 = off)
#   scripts/bench-proxy.sh --floor              # also dlx-floor (epoll, uring, threads) in the
#                                               # raw-client runs: a forwarder that only copies
#                                               # bytes, the floor under any proxy's cost
#   scripts/bench-proxy.sh --deadletter-only    # only the dead-letter rates (below)
#   scripts/bench-proxy.sh --capture-prefetch 64  # the proxy's proxy.capture_prefetch
#   scripts/bench-proxy.sh --deadletter-only --proxies 3   # the fleet: 3 proxies, each with
#                                               # upstream.urls = RABBIT_UPSTREAMS (a cluster,
#                                               # scripts/rabbit-local.sh start DIR 3)
#
# Dead-letter rates (every run, or alone with --deadletter-only): the five modes (reject, nack,
# expiry, overflow, delivery-limit; DL_KINDS to choose them, empty for none; DL_CLIENT=raw|lapin;
# DL_MESSAGES per run, default -n), RabbitMQ's own dead-lettering with the client on RabbitMQ
# directly against the same through proxy 1, alternating within each round. Reported: dead letters
# per second into the DLQ, CPU per dead letter (RabbitMQ's for direct; the proxies' together
# otherwise) and the latency from each death's cause to the dead letter's arrival (p50/p99).
#
# Needs a running RabbitMQ: RABBIT_URL (default amqp://guest:guest@127.0.0.1:5673/%2f, the node
# `.ci/rabbitmq.sh start` runs) and RABBIT_PID (default: the first `pgrep -x beam.smp`);
# `scripts/rabbit-local.sh start DIR [N]` starts nodes of one's own and writes DIR/env with
# these (source it).
# --pinned moves RabbitMQ's threads with taskset (needs the right to) and puts them back after.
# Results: BENCH_OUT (default target/bench-proxy-<time>/): results.jsonl and table.txt.
# A smoke run: PINGS=200 scripts/bench-proxy.sh --rounds 1 -n 2000
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=2
MESSAGES=50000
PINGS=${PINGS:-10000}
PINNED=0
WORKERS=0
BUSY_POLL=0
FLOOR=0
DEADLETTER_ONLY=0
PROXIES=1
CAPTURE_PREFETCH=1000
while [ $# -gt 0 ]; do
  case "$1" in
    --pinned) PINNED=1 ;;
    --rounds) ROUNDS="$2"; shift ;;
    -n) MESSAGES="$2"; shift ;;
    --worker-threads) WORKERS="$2"; shift ;;
    --busy-poll) BUSY_POLL="$2"; shift ;;
    --floor) FLOOR=1 ;;
    --deadletter-only) DEADLETTER_ONLY=1 ;;
    --proxies) PROXIES="$2"; shift ;;
    --capture-prefetch) CAPTURE_PREFETCH="$2"; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

RABBIT_URL=${RABBIT_URL:-amqp://guest:guest@127.0.0.1:5673/%2f}
DL_KINDS=${DL_KINDS-reject nack expiry overflow delivery-limit}
DL_CLIENT=${DL_CLIENT:-raw}
RABBIT_PID=${RABBIT_PID:-$(pgrep -x beam.smp | head -1 || true)}
if [ -z "$RABBIT_PID" ]; then
  echo "no RabbitMQ process found; start one (sudo bash .ci/rabbitmq.sh start) or set RABBIT_PID" >&2
  exit 2
fi

# HAProxy: the Debian package, installed when absent (its service is not started).
HAPROXY=$(command -v haproxy || true)
if [ -z "$HAPROXY" ] && [ -x /usr/sbin/haproxy ]; then HAPROXY=/usr/sbin/haproxy; fi
if [ -z "$HAPROXY" ]; then
  echo "== installing haproxy (apt-get)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq haproxy > /dev/null
  HAPROXY=/usr/sbin/haproxy
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
OUT=${BENCH_OUT:-$CARGO_TARGET_DIR/bench-proxy-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/config"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"

echo "== building (release, feature bench)"
cargo build --release --features bench --bins --quiet
BIN="$CARGO_TARGET_DIR/release"

# shellcheck source=scripts/lib.sh
. scripts/lib.sh
port=$(free_port)
# RabbitMQ's address without credentials and vhost, for upstream.url.
upstream=$(python3 -c 'import sys, urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(f"{p.scheme}://{p.hostname}:{p.port or 5672}")' "$RABBIT_URL")
# The proxy's service user (its capture connection): RABBIT_URL's user.
service_user=$(python3 -c 'import sys, urllib.parse as u; print(u.unquote(u.urlsplit(sys.argv[1]).username or "guest"))' "$RABBIT_URL")
service_password=$(python3 -c 'import sys, urllib.parse as u; print(u.unquote(u.urlsplit(sys.argv[1]).password or "guest"))' "$RABBIT_URL")
# upstream.urls: every node of RABBIT_UPSTREAMS (a cluster), else RabbitMQ's address.
upstream_urls=${RABBIT_UPSTREAMS:-\"$upstream\"}
proxy_config() {
  cat <<EOF
mode = "proxy"
[listen]
amqp = "127.0.0.1:$1"
admin = ""
[upstream]
urls = [$upstream_urls]
user = "$service_user"
password = "$service_password"
[log]
filter = "warn"
[proxy]
busy_poll_us = $BUSY_POLL
capture_prefetch = $CAPTURE_PREFETCH
[runtime]
worker_threads = $WORKERS
EOF
}
proxy_config "$port" > "$OUT/config/proxy.toml"
PROXY_URL="amqp://guest:guest@127.0.0.1:$port/%2f"

# HAProxy in TCP mode in front of the same RabbitMQ, with as many threads as the proxy's
# runtime (0 = HAProxy's default, one per core).
haproxy_port=$(free_port)
haproxy_threads=""
if [ "$WORKERS" != 0 ]; then haproxy_threads="  nbthread $WORKERS"; fi
cat > "$OUT/config/haproxy.cfg" <<EOF
global
  # Each connection takes two descriptors; keep within the usual hard limit.
  maxconn 4096
$haproxy_threads
defaults
  mode tcp
  timeout connect 5s
  timeout client 1h
  timeout server 1h
frontend amqp
  bind 127.0.0.1:$haproxy_port
  default_backend rabbitmq
backend rabbitmq
  server rabbitmq ${upstream#*://}
EOF
"$HAPROXY" -c -q -f "$OUT/config/haproxy.cfg"

# Forwarders in front of RabbitMQ: who -> "pid url".
declare -A TARGET
wait_ports_extra=()
"$BIN/dlx-proxy" run --config "$OUT/config/proxy.toml" > "$OUT/proxy.log" 2>&1 &
TARGET[proxy]="$! $PROXY_URL"
# The fleet: more proxies on the same upstreams (they share the capture queue).
PROXY_PIDS="$!"
for i in $(seq 2 "$PROXIES"); do
  fleet_port=$(free_port)
  proxy_config "$fleet_port" > "$OUT/config/proxy$i.toml"
  "$BIN/dlx-proxy" run --config "$OUT/config/proxy$i.toml" > "$OUT/proxy$i.log" 2>&1 &
  TARGET[proxy$i]="$! amqp://guest:guest@127.0.0.1:$fleet_port/%2f"
  PROXY_PIDS="$PROXY_PIDS $!"
  wait_ports_extra+=("$fleet_port")
done
# -db: stay in the foreground (no daemon), so that $! is HAProxy's own process.
"$HAPROXY" -db -f "$OUT/config/haproxy.cfg" > "$OUT/haproxy.log" 2>&1 &
TARGET[haproxy]="$! amqp://guest:guest@127.0.0.1:$haproxy_port/%2f"
wait_ports=("$port" "$haproxy_port" "${wait_ports_extra[@]}")
FLOORS=()
if [ "$FLOOR" = 1 ]; then
  rabbit_addr=${upstream#*://}
  for mode in epoll uring threads; do
    floor_port=$(free_port)
    "$BIN/dlx-floor" --mode "$mode" --listen "127.0.0.1:$floor_port" --upstream "$rabbit_addr" \
      > "$OUT/floor-$mode.log" 2>&1 &
    TARGET[floor-$mode]="$! amqp://guest:guest@127.0.0.1:$floor_port/%2f"
    FLOORS+=("floor-$mode")
    wait_ports+=("$floor_port")
  done
fi
CLIENT_CPUS=""
if [ "$PINNED" = 1 ]; then
  for who in "${!TARGET[@]}"; do taskset -a -p 0x2 "${TARGET[$who]%% *}" > /dev/null; done
  taskset -a -p 0x1 "$RABBIT_PID" > /dev/null
  CLIENT_CPUS="taskset 0x1"
fi
cleanup() {
  for who in "${!TARGET[@]}"; do kill "${TARGET[$who]%% *}" 2>/dev/null || true; done
  if [ "$PINNED" = 1 ]; then taskset -a -p 0x3 "$RABBIT_PID" > /dev/null || true; fi
}
trap cleanup EXIT
for p in "${wait_ports[@]}"; do
  for _ in $(seq 1 100); do
    if (echo > "/dev/tcp/127.0.0.1/$p") 2>/dev/null; then break; fi
    sleep 0.1
  done
done
for who in "${!TARGET[@]}"; do
  if ! kill -0 "${TARGET[$who]%% *}" 2>/dev/null; then
    echo "$who did not start; see $OUT/$who.log" >&2
    exit 1
  fi
done

# One run: who (direct, haproxy, proxy or a floor-* forwarder), then dlx-bench arguments.
run() {
  local round=$1 who=$2; shift 2
  local url=$RABBIT_URL pid=$RABBIT_PID
  if [ "$who" != direct ]; then pid=${TARGET[$who]%% *}; url=${TARGET[$who]#* }; fi
  local line
  line=$($CLIENT_CPUS "$BIN/dlx-bench" "$@" --url "$url" --pid "$pid" --label "$who" --json 2>>"$OUT/bench.log" | tail -1)
  case "$line" in
    \{*) echo "{\"round\":$round,\"who\":\"$who\",${line#\{}" >> "$RESULTS" ;;
    *) echo "run failed: $who $*" >&2 ;;
  esac
}

# CPU ticks (user + system) of the given processes, summed.
cpu_ticks() {
  local total=0 pid
  for pid in "$@"; do
    if [ -r "/proc/$pid/stat" ]; then
      total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
    fi
  done
  echo "$total"
}
CLK_TCK=$(getconf CLK_TCK)

# One dead-letter run: who (direct or proxy), the kind. The CPU of every proxy of the fleet
# (fleet_cpu_us_per_msg: the capture queue feeds them all) and of every RabbitMQ node
# (rabbit_cpu_us_per_msg: through the proxy it also runs the capture queue) are added up.
RABBIT_PIDS=${RABBIT_PIDS:-$RABBIT_PID}
dl_run() {
  local round=$1 who=$2 kind=$3
  local before after rabbit_before rabbit_after
  before=$(cpu_ticks $PROXY_PIDS)
  rabbit_before=$(cpu_ticks $RABBIT_PIDS)
  run "$round" "$who" deadletter --kind "$kind" --client "$DL_CLIENT" -n "${DL_MESSAGES:-$MESSAGES}"
  after=$(cpu_ticks $PROXY_PIDS)
  rabbit_after=$(cpu_ticks $RABBIT_PIDS)
  if [ "$(tail -1 "$RESULTS" | grep -c "\"who\":\"$who\"")" = 1 ]; then
    python3 - "$RESULTS" "$((after - before))" "$((rabbit_after - rabbit_before))" "$CLK_TCK" "$who" <<'PY'
import json, sys
path, ticks, rabbit, hz, who = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lines = open(path).read().splitlines()
last = json.loads(lines[-1])
n = last.get("dead_lettered") or 1
if who != "direct":
    last["fleet_cpu_us_per_msg"] = ticks * 1e6 / hz / n
last["rabbit_cpu_us_per_msg"] = rabbit * 1e6 / hz / n
lines[-1] = json.dumps(last)
open(path, "w").write("\n".join(lines) + "\n")
PY
  fi
}

# The paths of one row, rotated by the round: each takes every place in turn (first after the
# previous row, right after another forwarder, last), so no path always follows the same one.
rotated() {
  local round=$1; shift
  local n=$# i
  local all=("$@")
  for i in $(seq 0 $((n - 1))); do echo "${all[$(((i + round - 1) % n))]}"; done
}

for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round"
  for kind in $DL_KINDS; do
    for who in $(rotated "$round" direct proxy); do
      dl_run "$round" "$who" "$kind"
    done
  done
  if [ "$DEADLETTER_ONLY" = 1 ]; then continue; fi
  for client in lapin raw; do
    whos=(direct haproxy proxy)
    if [ "$client" = raw ]; then whos+=("${FLOORS[@]}"); fi
    for size in 100 4096; do
      for confirms in off on; do
        for who in $(rotated "$round" "${whos[@]}"); do
          run "$round" "$who" throughput --client "$client" -n "$MESSAGES" --size "$size" --confirms "$confirms"
        done
      done
    done
  done
  for size in 100 4096; do
    for confirms in off on; do
      for who in $(rotated "$round" direct haproxy proxy "${FLOORS[@]}"); do
        run "$round" "$who" ping -n "$PINGS" --size "$size" --confirms "$confirms"
      done
    done
  done
done

python3 - "$RESULTS" <<'EOF' | tee "$OUT/table.txt"
import collections, json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
groups = collections.defaultdict(lambda: collections.defaultdict(list))
dead = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    if r["scenario"].startswith("deadletter-"):
        dead[(r["scenario"][len("deadletter-"):], r.get("client", "raw"))][r["who"]].append(r)
        continue
    key = (r["scenario"], r.get("client", "raw"), r["size_bytes"], r["confirms"])
    groups[key][r["who"]].append(r)
failed = [r for r in rows if not r.get("ok", False)]
med = lambda rs, k: statistics.median(r[k] for r in rs)
# CPU time comes from the threads' schedstat (nanoseconds), or clock ticks where that is not
# readable: a short run can then measure 0 (the ratio is then nan).
div = lambda a, b: a / b if b else float("nan")
def per_round(top, bottom, key):
    """Each round's ratio of `key` between two paths' runs (rounds where both ran)."""
    rounds = collections.defaultdict(dict)
    for side, rs in (("top", top), ("bottom", bottom)):
        for r in rs:
            rounds[r["round"]][side] = r[key]
    return " ".join(f"{div(x['top'], x['bottom']):.2f}" for _, x in sorted(rounds.items()) if len(x) == 2)
if groups:
    print(f"{'scenario':<46} {'through':<14} {'direct':>9} {'through':>9} {'vs direct':>10} {'CPU us/msg':>11} {'CPU / RabbitMQ':>15}")
order = ["haproxy", "proxy", "floor-epoll", "floor-uring", "floor-threads"]
for (scenario, client, size, confirms), by in sorted(groups.items()):
    d = by.get("direct")
    if not d:
        continue
    name = f"{scenario} {client} {size} B confirms {confirms}"
    for who in sorted((w for w in by if w != "direct"), key=lambda w: (w not in order, order.index(w) if w in order else 0, w)):
        p = by[who]
        us = med(p, "broker_cpu_us_per_msg")
        cpu = div(us, med(d, "broker_cpu_us_per_msg"))
        if scenario == "ping":
            dv, pv = med(d, "rtt_p50_us"), med(p, "rtt_p50_us")
            print(f"{name + ' p50 us':<46} {who:<14} {dv:>9.0f} {pv:>9.0f} {'+%.0f us' % (pv - dv):>10} {us:>11.2f} {cpu:>15.0%}")
        else:
            dv, pv = med(d, "rate_msg_s"), med(p, "rate_msg_s")
            print(f"{name + ' msg/s':<46} {who:<14} {dv:>9.0f} {pv:>9.0f} {div(pv, dv):>10.0%} {us:>11.2f} {cpu:>15.0%}")
# The proxy against HAProxy (issue targets: >= 1.0x its msg/s, <= 1.1x its CPU per message).
if groups:
    print()
    print(f"{'proxy / HAProxy':<46} {'speed':>9} {'CPU/msg':>9}   (proxy msg/s or p50 us, CPU us/msg | HAProxy's)")
for (scenario, client, size, confirms), by in sorted(groups.items()):
    p, h = by.get("proxy"), by.get("haproxy")
    if not p or not h:
        continue
    name = f"{scenario} {client} {size} B confirms {confirms}"
    pc, hc = med(p, "broker_cpu_us_per_msg"), med(h, "broker_cpu_us_per_msg")
    key = "rtt_p50_us" if scenario == "ping" else "rate_msg_s"
    pv, hv = med(p, key), med(h, key)
    # Round trips: lower is better, so the speed ratio is HAProxy's p50 over the proxy's.
    speed = div(hv, pv) if scenario == "ping" else div(pv, hv)
    # Each round's CPU ratio, to show the spread under the median.
    spread = per_round(p, h, "broker_cpu_us_per_msg")
    print(f"{name:<46} {speed:>8.2f}x {div(pc, hc):>8.2f}x   ({pv:.0f}, {pc:.2f} | {hv:.0f}, {hc:.2f})  CPU per round: {spread}")
if dead:
    print()
    print("dead letters: msg/s (median of rounds), proxy/direct per round, CPU us per dead letter, latency from the death's cause p50/p99 (ms)")
    print(f"{'kind':<16} {'client':<6} {'direct msg/s':>13} {'proxy msg/s':>12} {'ratio':>6}  {'per round':<24} {'RabbitMQ CPU direct/proxied':>28} {'CPU proxies':>11} {'p50/p99 direct':>15} {'p50/p99 proxy':>15}")
    for (kind, client), by in sorted(dead.items()):
        d, p = by.get("direct"), by.get("proxy")
        if not d or not p:
            continue
        dv, pv = med(d, "dead_letter_rate_msg_s"), med(p, "dead_letter_rate_msg_s")
        rounds = per_round(p, d, "dead_letter_rate_msg_s")
        pc = statistics.median(r.get("fleet_cpu_us_per_msg", r["broker_cpu_us_per_msg"]) for r in p)
        lat = lambda rs: f"{med(rs, 'latency_p50_us') / 1000:.1f}/{med(rs, 'latency_p99_us') / 1000:.1f}"
        rc = lambda rs: statistics.median(r.get("rabbit_cpu_us_per_msg", float("nan")) for r in rs)
        rabbit = f"{rc(d):.1f} / {rc(p):.1f}"
        print(f"{kind:<16} {client:<6} {dv:>13.0f} {pv:>12.0f} {div(pv, dv):>6.2f}  {rounds:<24} {rabbit:>28} {pc:>11.1f} {lat(d):>15} {lat(p):>15}")
print(f"{len(rows)} runs, {len(failed)} failed (lost, duplicated or reordered messages)")
sys.exit(1 if failed else 0)
EOF
