#!/usr/bin/env bash
# Instruction ratios of shardkit over plain SeaORM (see overhead.rs): each
# variant runs under callgrind at two operation counts; the marginal
# instructions per operation are (I(N2) - I(N1)) / (N2 - N1). Counted on the
# main thread, where shardkit, SeaORM and the drivers' client side run (the
# program uses a current-thread runtime): SQLx's SQLite worker threads run the
# same SQLite work in both modes.
#
# How often a future is polled before the database answers depends on timing
# (an answer not yet there costs another trip through the event loop), so
# counts of identical runs still differ by a few percent. The variants run
# interleaved, ROUNDS times; the lowest marginal count of each (the run with
# the fewest wasted polls) is the one compared, and the spread is printed.
# Then the same for a keyed read with a session (Consistency::AtLeast, no
# replica) over the keyed read without one: the session's bookkeeping.
# Usage: tests/benches/overhead.sh [N1 N2 ROUNDS]   (PostgreSQL at SHARDKIT_PG_URL)
# With ONLY=session, only the session rows.
set -euo pipefail
cd "$(dirname "$0")/../.."
n1="${1:-100}"
n2="${2:-400}"
rounds="${3:-3}"
bin=$(cargo bench -p shardkit-tests --bench overhead --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "overhead" and m.get("executable"):
        print(m["executable"])')
out=$(mktemp -d)
count() { # mode backend op n -> main-thread instructions
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg.%p" \
    "$bin" "$@" >/dev/null 2>"$out/log"
  grep -h "^summary:" "$out"/cg.*-01 | awk '{s+=$2} END {print s}'
  rm -f "$out"/cg.*
}
compare() { # base other label cases...
  local base=$1 other=$2 label=$3; shift 3
  printf '%-9s %-7s %22s %22s %7s\n' backend op "$base/op (min..max)" "$other/op (min..max)" "$label"
  for case in "$@"; do
    set -- $case
    samples=""
    for _ in $(seq 1 "$rounds"); do
      for mode in "$base" "$other"; do
        a=$(count "$mode" "$1" "$2" "$n1")
        b=$(count "$mode" "$1" "$2" "$n2")
        samples="$samples $mode:$(( (b - a) / (n2 - n1) ))"
      done
    done
    python3 - "$1" "$2" "$base" "$other" $samples <<'PY'
import sys
backend, op, base, other, *samples = sys.argv[1:]
per = {base: [], other: []}
for s in samples:
    mode, n = s.split(":")
    per[mode].append(int(n))
p, k = per[base], per[other]
print(f"{backend:<9} {op:<7} {min(p):>9} ({min(p)}..{max(p)}) {min(k):>9} ({min(k)}..{max(k)}) {min(k)/min(p):7.3f}")
PY
  done
}
if [ "${ONLY:-}" != session ]; then
  compare plain shardkit ratio "sqlite read" "postgres read" "sqlite update" "postgres update"
fi
compare shardkit session "session ratio" "sqlite read" "postgres read"
rm -rf "$out"
