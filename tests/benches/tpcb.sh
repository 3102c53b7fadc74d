#!/usr/bin/env bash
# Client instructions per TPC-B transaction (see tpcb.rs): plain SeaORM
# against shardkit on one shard, then shardkit on one shard against four,
# under callgrind (see callgrind.sh), on PostgreSQL and MySQL/MariaDB.
# Usage: tests/benches/tpcb.sh [N1 N2 ROUNDS]   (default 500 2000 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
n1="${1:-500}"
n2="${2:-2000}"
rounds="${3:-2}"
# shellcheck source=callgrind.sh
. tests/benches/callgrind.sh
bin=$(bench_bin tpcb)
compare plain one ratio postgres mysql
