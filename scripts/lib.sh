# Shared by the benchmark scripts (sourced, not run): free ports, waiting for a port, and one
# recorded dlx-bench run. The caller sets BIN (the directory of the release binaries), OUT
# (where logs go), RESULTS (the results.jsonl file) and FAILED=0.

# free_port: a TCP port nothing listens on now.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_port PORT: waits up to 20 s for something to listen on PORT.
wait_port() {
  for _ in $(seq 1 200); do
    if (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  return 1
}

# bench_run ROUND BROKER CASE URL PID ARGS...: one dlx-bench run against URL (the broker's
# process PID for its CPU time); its JSON result, with the round, broker, case and the load
# before the run, goes to $RESULTS. A failed run is recorded as such and sets FAILED=1.
bench_run() {
  local round=$1 broker=$2 case=$3 url=$4 pid=$5
  shift 5
  local log="$OUT/$broker-$case-r$round.log" load rc=0 json
  load=$(cut -d' ' -f1 /proc/loadavg)
  echo "-- round $round  $broker  $case  (load $load)"
  "$BIN/dlx-bench" --url "$url" --pid "$pid" --label "$broker" --json "$@" > "$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    echo "   FAILED (exit $rc): see $log"
    grep -E 'FAILED|dlx-bench:' "$log" | sed 's/^/   /' || true
    FAILED=1
  fi
  json=$(tail -n 1 "$log")
  if [ "${json:0:1}" = "{" ]; then
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(round=int(sys.argv[2]), broker=sys.argv[3], case=sys.argv[4], load_before=float(sys.argv[5]), exit=int(sys.argv[6])); print(json.dumps(d))' \
      "$json" "$round" "$broker" "$case" "$load" "$rc" >> "$RESULTS"
  else
    echo "{\"round\": $round, \"broker\": \"$broker\", \"case\": \"$case\", \"exit\": $rc, \"ok\": false}" >> "$RESULTS"
  fi
}
