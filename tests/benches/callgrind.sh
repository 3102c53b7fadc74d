# Instruction counts under callgrind, sourced by overhead.sh and tpcb.sh.
#
# bench_bin NAME: the path of bench NAME's executable (built if needed).
# compare BASE OTHER LABEL CASES...: for each case (the bench's arguments
# between the mode and the operation count, as one word list), runs modes
# BASE and OTHER interleaved ROUNDS times at N1 and N2 operations and prints
# the marginal main-thread instructions per operation, (I(N2) - I(N1)) /
# (N2 - N1), the lowest of each mode (the run with the fewest wasted polls)
# with the spread, and OTHER's over BASE's.
#
# Counted on the main thread, where shardkit, SeaORM and the drivers' client
# side run (the programs use a current-thread runtime). How often a future
# is polled before the database answers depends on timing, so counts of
# identical runs differ by a few percent: hence the rounds and the minimum.
# Each park of the runtime in between (an answer not there yet) costs a few
# thousand instructions, so the totals are bimodal; the "poll path" columns
# count the benchmark's future alone ($future, callgrind's inclusive cost),
# which leaves the park out and moves much less.
# Needs: n1, n2, rounds, future.
#
# PostgreSQL without TLS unless PGSSLMODE says otherwise (sqlx reads it): a
# TLS handshake costs about 1.5 million instructions, and whether the main
# thread's count holds one more or one fewer varied from run to run (11.3M
# and 12.8M of ring's code in two runs of 100 reads, 13.6M in runs of 400),
# a few thousand instructions per operation either way in the marginal
# count, more than the differences measured. Connecting is not per
# operation; what TLS costs per statement is the same for every variant.
: "${PGSSLMODE:=disable}"
export PGSSLMODE

bench_bin() {
  cargo bench -p shardkit-tests --bench "$1" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$1"
}

callgrind_out=$(mktemp -d)
trap 'rm -rf "$callgrind_out"' EXIT

count() { # bench-args... -> "main-thread-total poll-path" instructions
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$callgrind_out/cg.%p" \
    "$bin" "$@" >/dev/null 2>"$callgrind_out/log"
  total=$(grep -h "^summary:" "$callgrind_out"/cg.*-01 | awk '{s+=$2} END {print s}')
  # The inclusive count of the benchmark's future ($future): its polls
  # only, without the runtime's park in between.
  poll=$(callgrind_annotate --inclusive=yes --threshold=100 "$callgrind_out"/cg.*-01 2>/dev/null \
    | F="$future" awk '{
        line = $0; sub(/ \[.*\]$/, "", line); f = ENVIRON["F"]; at = length(line) - length(f)
        if (substr(line, at + 1) == f && substr(line, at, 1) == ":") { gsub(",", "", $1); print $1; exit }
      }')
  echo "$total ${poll:-0}"
  rm -f "$callgrind_out"/cg.*
}

compare() { # base other label cases...
  local base=$1 other=$2 label=$3; shift 3
  printf '%-18s %22s %22s %7s\n' case "$base/op (min..max)" "$other/op (min..max)" "$label"
  for case in "$@"; do
    samples=""
    for _ in $(seq 1 "$rounds"); do
      for mode in "$base" "$other"; do
        # shellcheck disable=SC2086 # a case is a word list
        read -r a pa <<<"$(count "$mode" $case "$n1")"
        # shellcheck disable=SC2086
        read -r b pb <<<"$(count "$mode" $case "$n2")"
        samples="$samples $mode:$(( (b - a) / (n2 - n1) )):$(( (pb - pa) / (n2 - n1) ))"
      done
    done
    python3 - "$case" "$base" "$other" $samples <<'PY'
import sys
case, base, other, *samples = sys.argv[1:]
per = {base: [], other: []}
polls = {base: [], other: []}
for s in samples:
    mode, n, poll = s.split(":")
    per[mode].append(int(n))
    polls[mode].append(int(poll))
p, k = per[base], per[other]
pp, pk = polls[base], polls[other]
poll = f"{min(pk)/min(pp):7.3f}" if min(pp) > 0 else "      -"
print(f"{case:<18} {min(p):>9} ({min(p)}..{max(p)}) {min(k):>9} ({min(k)}..{max(k)}) {min(k)/min(p):7.3f}"
      f"   poll path {min(pp)} ({min(pp)}..{max(pp)}) {min(pk)} ({min(pk)}..{max(pk)}) {poll}")
PY
  done
}
