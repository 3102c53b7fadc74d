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
future="overhead::run::{{closure}}"
rounds="${3:-3}"
# shellcheck source=callgrind.sh
. tests/benches/callgrind.sh
bin=$(bench_bin overhead)
if [ "${ONLY:-}" != session ]; then
  compare plain shardkit ratio "sqlite read" "postgres read" "sqlite update" "postgres update" \
    "sqlite delete" "postgres delete"
fi
compare shardkit session "session ratio" "sqlite read" "postgres read"
