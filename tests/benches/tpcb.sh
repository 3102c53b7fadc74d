#!/usr/bin/env bash
# Client instructions per TPC-B transaction (see tpcb.rs): plain SeaORM
# against shardkit on one shard, then plain SeaORM with shardkit's key
# predicate against shardkit on one shard,
# under callgrind (see callgrind.sh), on PostgreSQL and MySQL/MariaDB.
# Usage: tests/benches/tpcb.sh [N1 N2 ROUNDS]   (default 500 2000 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
n1="${1:-500}"
n2="${2:-2000}"
future="tpcb::Setup::run::{{closure}}"
rounds="${3:-2}"
# shellcheck source=callgrind.sh
. tests/benches/callgrind.sh
bin=$(bench_bin tpcb)
compare plain one ratio postgres mysql
# The same against plain SeaORM sending shardkit's statements (each with
# the key predicate): what shardkit's own work costs.
compare keyed one ratio postgres mysql
