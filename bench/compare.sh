#!/usr/bin/env bash
# Side-by-side throughput: the relay vs Postfix, same machine, same run, alternating
# A B A B ... and reporting each run and the median ratio (relay / Postfix).
#
#   bench/compare.sh [ROUNDS] [N] [SESSIONS] [SIZE]      (defaults: 5 5000 20 2048)
#   MODE=accept bench/compare.sh ...   inbound acceptance only: delivery is held on both
#                                      sides (Postfix: defer_transports=smtp; relay: the
#                                      smarthost destination suspended), so accept_s is the
#                                      time to take N messages with fsync, nothing else.
#
# Needs root (installs and configures Debian's postfix as the peer on 127.0.0.1:25, which
# relays to smtp-sink on :2526). The relay listens on 127.0.0.1:2525 and relays to
# smtp-sink on :2527, with the per-destination rate set to unlimited and 20 connections
# (Postfix's default per-destination concurrency), fsync on as always.
# Loopback only. Results: bench/results/compare-<date>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}; N=${2:-5000}; S=${3:-20}; SIZE=${4:-2048}; MODE=${MODE:-e2e}
export PATH=$PATH:/usr/sbin:/usr/bin
SHARED=${SHARED_BENCH:-../shared/bench}
[ -x .venv/bin/relay ] || make .venv/.installed >/dev/null
bash "$SHARED/postfix-peer.sh" 2526 >/dev/null
if [ "$MODE" = accept ]; then
  postconf -e defer_transports=smtp && postfix reload >/dev/null 2>&1
  export E2E_TIMEOUT=0
fi
WORK=$(mktemp -d)
cat > "$WORK/relay.yaml" <<YAML
listen:
  - address: 127.0.0.1:2525
spool:
  path: ./spool
upstream:
  mode: smarthost
  smarthost: {host: 127.0.0.1, port: 2527, tls: none}
destinations:
  "*": {rate: unlimited, max_connections: 20}
admin: {listen: null}
log: {level: warning}
YAML
.venv/bin/relay serve -c "$WORK/relay.yaml" > "$WORK/relay.log" 2>&1 &
RELAY=$!
cleanup() {
  kill $RELAY 2>/dev/null; wait $RELAY 2>/dev/null; rm -rf "$WORK"
  if [ "$MODE" = accept ]; then
    postconf -e defer_transports= && postfix reload >/dev/null 2>&1; postsuper -d ALL >/dev/null 2>&1
  fi
}
trap cleanup EXIT
for _ in $(seq 50); do (echo > /dev/tcp/127.0.0.1/2525) 2>/dev/null && break; sleep 0.1; done
[ "$MODE" = accept ] && .venv/bin/relay destination suspend smarthost --for 1h -c "$WORK/relay.yaml" >/dev/null 2>&1
mkdir -p bench/results
OUT=bench/results/compare-$(date -u +%Y%m%dT%H%M%SZ).txt
echo "# $(date -u) mode=$MODE N=$N sessions=$S size=$SIZE rounds=$ROUNDS $(nproc) cores" | tee "$OUT"
for i in $(seq "$ROUNDS"); do
  p=$(bash "$SHARED/e2e.sh" 127.0.0.1:25 2526 "$N" "$S" "$SIZE")
  echo "postfix $p" | tee -a "$OUT"
  r=$(bash "$SHARED/e2e.sh" 127.0.0.1:2525 2527 "$N" "$S" "$SIZE")
  echo "relay   $r" | tee -a "$OUT"
  [ "$MODE" = accept ] && postsuper -d ALL >/dev/null 2>&1
done
echo "relay peak RSS: $(awk '/VmHWM/ {print $2, $3}' /proc/$RELAY/status)" | tee -a "$OUT"
MODE=$MODE python3 - "$OUT" <<'PY' | tee -a "$OUT"
import os, re, statistics, sys
rows = {"postfix": [], "relay": []}
for line in open(sys.argv[1]):
    m = re.match(r"(postfix|relay)\s+delivered=(\d+) accept_s=([\d.]+) e2e_s=([\d.]+) e2e_msgs_per_s=(\d+)", line)
    if m:
        rows[m.group(1)].append((int(m.group(2)), float(m.group(3)), float(m.group(4))))
n = min(len(rows["postfix"]), len(rows["relay"]))
acc = [rows["postfix"][i][1] / rows["relay"][i][1] for i in range(n)]
e2e = [rows["postfix"][i][2] / rows["relay"][i][2] for i in range(n)]
lost = [r[0] for r in rows["relay"]]
print(f"relay/postfix accept-rate ratio per round: {[round(x, 2) for x in acc]} median {statistics.median(acc):.2f}")
print(f"relay/postfix end-to-end ratio per round:  {[round(x, 2) for x in e2e]} median {statistics.median(e2e):.2f}")
note = " (accept mode: delivery is held, 0 is expected)" if os.environ["MODE"] == "accept" else ""
print(f"relay delivered per round: {lost}{note}")
PY

