#!/usr/bin/env bash
# Replicated database servers for shardkit's replica-read tests, on ports that
# do not clash with the default servers (PostgreSQL 5432, MariaDB 3306, which
# this script never touches):
#
#   PostgreSQL 15 primary   127.0.0.1:5442   postgres, trust auth
#   PostgreSQL 15 replica   127.0.0.1:5443   streaming replica, hot_standby
#   PostgreSQL 15 replica   127.0.0.1:5444   a second streaming replica (reads spread over two servers)
#   MariaDB primary         127.0.0.1:3316   root, empty password
#   MariaDB replica         127.0.0.1:3317   GTID replica (MASTER_USE_GTID=slave_pos), read_only
#
# Usage: scripts/replicas.sh start|stop|status|reset|env
#        scripts/replicas.sh pause-replay pg|mariadb
#        scripts/replicas.sh resume-replay pg|mariadb
#        scripts/replicas.sh delay pg MILLISECONDS | delay mariadb SECONDS
#
# start          create what is missing, start what is stopped, wait until all
#                five servers accept connections and the three replicas replicate,
#                then print the SHARDKIT_*_URL exports. Idempotent. A replica
#                that was cloned from an earlier (since reset) primary, or that
#                cannot catch up any more, is rebuilt. Replicas start with no
#                apply delay (one an interrupted test left is cleared).
# stop           stop the five servers (data is kept).
# status         up/down and replication state of each server.
# reset          stop and delete all data; the next start is fresh.
# env            print the exports only.
# pause-replay   stop applying changes on the replica (it keeps receiving them),
#                to make replica lag on purpose. resume-replay undoes it.
# delay          apply every change that many ms (pg: recovery_min_apply_delay)
#                or whole seconds (mariadb: MASTER_DELAY) late; 0 undoes it.
#                Real, repeatable lag; the tests set it themselves the same way.
#
# Data and logs live in $SHARDKIT_REPLICAS_DIR (default /var/lib/shardkit-replicas).
# Run as root. $SHARDKIT_REPLICAS_TIMEOUT (default 60) bounds each wait, in seconds.
set -euo pipefail

BASE="${SHARDKIT_REPLICAS_DIR:-/var/lib/shardkit-replicas}"
TIMEOUT="${SHARDKIT_REPLICAS_TIMEOUT:-60}"

# PostgreSQL 15 (Debian 12's); else the newest installed major version.
if [ -z "${PG_BIN:-}" ]; then
  PG_BIN=/usr/lib/postgresql/15/bin
  [ -x "$PG_BIN/postgres" ] ||
    PG_BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)"
fi
PG_PRIMARY_PORT=5442
PG_REPLICA_PORT=5443
PG_SLOT=shardkit_replica
PG_PRIMARY_DIR="$BASE/pg-primary"
PG_REPLICA_DIR="$BASE/pg-replica"
PG_REPLICA2_PORT=5444
PG_SLOT2=shardkit_replica2
PG_REPLICA2_DIR="$BASE/pg-replica2"

MARIADBD="${MARIADBD:-/usr/sbin/mariadbd}"
MY_PRIMARY_PORT=3316
MY_REPLICA_PORT=3317
MY_REPL_USER=repl
MY_REPL_PASSWORD=repl
MY_PRIMARY_DIR="$BASE/mariadb-primary"
MY_REPLICA_DIR="$BASE/mariadb-replica"

# Each instance directory holds data/ (the server's data), run/ (socket, pid),
# log/ (server log), and .shardkit-ready once fully created; a directory
# without that marker is left over from an interrupted run and is rebuilt.
READY=.shardkit-ready

say() { printf '[replicas] %s\n' "$*" >&2; }

die() {
  say "ERROR: $1"
  shift
  local f
  for f in "$@"; do
    if [ -f "$f" ]; then
      printf -- '--- last lines of %s ---\n' "$f" >&2
      tail -n 40 "$f" >&2 || true
    fi
  done
  exit 1
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "run as root (it creates and runs servers as users postgres and mysql)"
}

# Serialise concurrent invocations. Servers are started with fd 9 closed so
# they do not inherit (and hold) the lock.
take_lock() {
  mkdir -p "$BASE"
  chmod 755 "$BASE"
  exec 9>"$BASE/.lock"
  flock -w "$TIMEOUT" 9 || die "another scripts/replicas.sh holds $BASE/.lock"
}

port_in_use() { [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]; }

# ---------------------------------------------------------------- PostgreSQL

as_pg() { runuser -u postgres -- "$@"; }

pg_q() { # port sql  -> unaligned, tuples only
  "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$1" -U postgres -d postgres -v ON_ERROR_STOP=1 -Atc "$2"
}

pg_log() { echo "$1/log/postgresql.log"; }

# Running = postmaster.pid names a live postgres process whose data dir is ours.
pg_running() {
  local dir="$1" pid
  [ -f "$dir/data/postmaster.pid" ] || return 1
  pid="$(head -n1 "$dir/data/postmaster.pid" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"-D $dir/data "* ]]
}

pg_clear_stale() {
  local dir="$1"
  if ! pg_running "$dir"; then
    rm -f "$dir/data/postmaster.pid" "$dir/run"/.s.PGSQL.*
  fi
}

pg_ready() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$1" -d postgres -U postgres >/dev/null 2>&1; }

pg_start() { # dir port
  local dir="$1" port="$2" log
  log="$(pg_log "$dir")"
  if pg_running "$dir"; then
    return 0
  fi
  pg_clear_stale "$dir"
  if port_in_use "$port"; then
    die "port $port is in use by something that is not $dir"
  fi
  say "starting PostgreSQL $dir on port $port"
  as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$log" -w -t "$TIMEOUT" -s \
    start >/dev/null 9>&- ||
    die "PostgreSQL in $dir did not start" "$log"
}

pg_wait_ready() { # dir port
  local i
  for i in $(seq 1 "$TIMEOUT"); do
    pg_ready "$2" && return 0
    sleep 1
  done
  die "PostgreSQL on port $2 does not accept connections after ${TIMEOUT}s" "$(pg_log "$1")"
}

pg_stop() { # dir
  local dir="$1"
  if pg_running "$dir"; then
    say "stopping PostgreSQL $dir"
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w -t "$TIMEOUT" -s stop >/dev/null ||
      die "PostgreSQL in $dir did not stop" "$(pg_log "$dir")"
  fi
  pg_clear_stale "$dir" 2>/dev/null || true
}

# Settings shared by both roles, rewritten on every start so edits here apply.
pg_write_conf() { # dir port role [slot application_name] (the last two for a replica)
  local dir="$1" port="$2" role="$3" slot="${4:-$PG_SLOT}" app="${5:-shardkit-replica}"
  cat >"$dir/data/shardkit.conf" <<EOF
# Written by shardkit scripts/replicas.sh on every start; edits are overwritten.
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir/run'
cluster_name = 'shardkit-$role'
max_connections = 100
shared_buffers = 32MB
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
wal_keep_size = 64MB
max_slot_wal_keep_size = 1GB
hot_standby = on
hot_standby_feedback = on
wal_receiver_status_interval = 1s
fsync = on
logging_collector = off
log_line_prefix = '%m [%p] '
EOF
  if [ "$role" = replica ]; then
    cat >>"$dir/data/shardkit.conf" <<EOF
primary_conninfo = 'host=127.0.0.1 port=$PG_PRIMARY_PORT user=postgres application_name=$app'
primary_slot_name = '$slot'
EOF
  fi
  chown postgres:postgres "$dir/data/shardkit.conf"
}

pg_write_hba() { # dir
  cat >"$1/data/pg_hba.conf" <<'EOF'
# Written by shardkit scripts/replicas.sh. Trust, like the default test server.
local   all          all                   trust
host    all          all    127.0.0.1/32   trust
host    all          all    ::1/128        trust
local   replication  all                   trust
host    replication  all    127.0.0.1/32   trust
host    replication  all    ::1/128        trust
EOF
  chown postgres:postgres "$1/data/pg_hba.conf"
}

pg_mkdirs() { # dir
  mkdir -p "$1/data" "$1/run" "$1/log"
  chown -R postgres:postgres "$1"
  chmod 700 "$1/data"
}

pg_sysid_of_dir() { # dir -> system identifier from pg_control
  "$PG_BIN/pg_controldata" "$1/data" 2>/dev/null | awk -F: '/Database system identifier/ {gsub(/ /, "", $2); print $2}'
}

pg_create_primary() {
  local dir="$PG_PRIMARY_DIR"
  pg_stop "$dir"
  rm -rf "$dir"
  pg_mkdirs "$dir"
  say "initdb PostgreSQL primary in $dir/data"
  as_pg "$PG_BIN/initdb" -D "$dir/data" -U postgres --auth=trust --encoding=UTF8 \
    --locale=C.UTF-8 >"$dir/log/initdb.log" 2>&1 ||
    die "initdb failed" "$dir/log/initdb.log"
  echo "include_if_exists = 'shardkit.conf'" >>"$dir/data/postgresql.conf"
  pg_write_hba "$dir"
  touch "$dir/$READY"
}

pg_ensure_slot() { # slot
  pg_q "$PG_PRIMARY_PORT" "SELECT pg_create_physical_replication_slot('$1', true)
    WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '$1')" >/dev/null
}

pg_create_replica() { # dir slot
  local dir="$1" slot="$2"
  pg_stop "$dir"
  rm -rf "$dir"
  pg_mkdirs "$dir"
  # A fresh slot: the old one may hold WAL for a replica that no longer exists.
  pg_q "$PG_PRIMARY_PORT" "SELECT pg_drop_replication_slot('$slot')
    FROM pg_replication_slots WHERE slot_name = '$slot' AND NOT active" >/dev/null
  pg_ensure_slot "$slot"
  say "pg_basebackup PostgreSQL replica into $dir/data"
  rm -rf "$dir/data"
  as_pg "$PG_BIN/pg_basebackup" -h 127.0.0.1 -p "$PG_PRIMARY_PORT" -U postgres \
    -D "$dir/data" -X stream -S "$slot" -c fast >"$dir/log/basebackup.log" 2>&1 ||
    die "pg_basebackup failed" "$dir/log/basebackup.log"
  chmod 700 "$dir/data"
  rm -f "$dir/data/postmaster.pid" "$dir/data/postmaster.opts"
  as_pg touch "$dir/data/standby.signal"
  touch "$dir/$READY"
}

pg_replica_streaming() { # port application_name
  [ "$(pg_q "$PG_PRIMARY_PORT" "SELECT count(*) FROM pg_stat_replication
        WHERE application_name = '$2' AND state = 'streaming'" 2>/dev/null)" = 1 ] &&
    [ "$(pg_q "$1" "SELECT pg_is_in_recovery()" 2>/dev/null)" = t ]
}

pg_wait_streaming() { # seconds port application_name -> 0 when streaming
  local i
  for i in $(seq 1 "$1"); do
    pg_replica_streaming "$2" "$3" && return 0
    sleep 1
  done
  return 1
}

pg_up() {
  # Primary.
  if [ ! -f "$PG_PRIMARY_DIR/$READY" ] || [ ! -f "$PG_PRIMARY_DIR/data/PG_VERSION" ]; then
    pg_create_primary
  fi
  pg_write_conf "$PG_PRIMARY_DIR" "$PG_PRIMARY_PORT" primary
  pg_start "$PG_PRIMARY_DIR" "$PG_PRIMARY_PORT"
  pg_wait_ready "$PG_PRIMARY_DIR" "$PG_PRIMARY_PORT"
  [ "$(pg_q "$PG_PRIMARY_PORT" "SELECT pg_is_in_recovery()")" = f ] ||
    die "the PostgreSQL primary on $PG_PRIMARY_PORT is in recovery" "$(pg_log "$PG_PRIMARY_DIR")"
  pg_ensure_slot "$PG_SLOT"
  pg_replica_up "$PG_REPLICA_DIR" "$PG_REPLICA_PORT" "$PG_SLOT" shardkit-replica
  pg_replica_up "$PG_REPLICA2_DIR" "$PG_REPLICA2_PORT" "$PG_SLOT2" shardkit-replica2
}

# One streaming replica: rebuilt when missing, half-made, or cloned from
# another primary; started; streaming; replaying.
pg_replica_up() { # dir port slot application_name
  local dir="$1" port="$2" slot="$3" app="$4" sysid rebuilt=0
  sysid="$(pg_q "$PG_PRIMARY_PORT" "SELECT system_identifier FROM pg_control_system()")"
  if [ ! -f "$dir/$READY" ] || [ ! -f "$dir/data/standby.signal" ]; then
    pg_create_replica "$dir" "$slot"; rebuilt=1
  elif [ "$(pg_sysid_of_dir "$dir")" != "$sysid" ]; then
    say "PostgreSQL replica $dir was cloned from an earlier primary; rebuilding it"
    pg_create_replica "$dir" "$slot"; rebuilt=1
  fi
  pg_write_conf "$dir" "$port" replica "$slot" "$app"
  pg_start "$dir" "$port"
  pg_wait_ready "$dir" "$port"
  if ! pg_wait_streaming "$TIMEOUT" "$port" "$app"; then
    [ "$rebuilt" = 0 ] ||
      die "PostgreSQL replica on $port is not streaming after ${TIMEOUT}s" \
        "$(pg_log "$dir")" "$(pg_log "$PG_PRIMARY_DIR")"
    say "PostgreSQL replica on $port does not stream (WAL gone?); rebuilding it"
    tail -n 10 "$(pg_log "$dir")" >&2 || true
    pg_create_replica "$dir" "$slot"
    pg_write_conf "$dir" "$port" replica "$slot" "$app"
    pg_start "$dir" "$port"
    pg_wait_ready "$dir" "$port"
    pg_wait_streaming "$TIMEOUT" "$port" "$app" ||
      die "PostgreSQL replica on $port is not streaming after ${TIMEOUT}s" \
        "$(pg_log "$dir")" "$(pg_log "$PG_PRIMARY_DIR")"
  fi
  if [ "$(pg_q "$port" "SELECT pg_is_wal_replay_paused()")" = t ]; then
    say "PostgreSQL replica on $port: replay was paused; resuming it"
    pg_q "$port" "SELECT pg_wal_replay_resume()" >/dev/null
  fi
  say "PostgreSQL primary :$PG_PRIMARY_PORT -> replica :$port streaming"
}

pg_down() {
  pg_stop "$PG_REPLICA2_DIR"
  pg_stop "$PG_REPLICA_DIR"
  pg_stop "$PG_PRIMARY_DIR"
}

pg_status() {
  local role dir port
  for role in primary replica replica2; do
    case "$role" in
      primary) dir="$PG_PRIMARY_DIR"; port="$PG_PRIMARY_PORT" ;;
      replica) dir="$PG_REPLICA_DIR"; port="$PG_REPLICA_PORT" ;;
      *) dir="$PG_REPLICA2_DIR"; port="$PG_REPLICA2_PORT" ;;
    esac
    if pg_ready "$port" && pg_running "$dir"; then
      printf 'postgres %-8s 127.0.0.1:%s up\n' "$role" "$port"
      if [ "$role" = primary ]; then
        printf '  current_wal_lsn=%s\n' "$(pg_q "$port" "SELECT pg_current_wal_lsn()" || echo '?')"
        pg_q "$port" "SELECT '  replication: ' || application_name || ' state=' || state
            || ' sent=' || coalesce(sent_lsn::text, '-') || ' replay=' || coalesce(replay_lsn::text, '-')
            || ' replay_lag=' || coalesce(replay_lag::text, '-')
          FROM pg_stat_replication" || true
        pg_q "$port" "SELECT '  slot ' || slot_name || ' active=' || active || ' restart_lsn='
            || coalesce(restart_lsn::text, '-') FROM pg_replication_slots" || true
      else
        pg_q "$port" "SELECT '  in_recovery=' || pg_is_in_recovery()
            || ' receive_lsn=' || coalesce(pg_last_wal_receive_lsn()::text, '-')
            || ' replay_lsn=' || coalesce(pg_last_wal_replay_lsn()::text, '-')
            || ' replay_paused=' || pg_is_wal_replay_paused()
            || ' last_replayed_xact=' || coalesce(pg_last_xact_replay_timestamp()::text, '-')" || true
        pg_q "$port" "SELECT '  wal_receiver: status=' || status || ' sender=' || sender_host || ':' || sender_port
          FROM pg_stat_wal_receiver" || true
      fi
    elif [ -d "$dir/data" ]; then
      printf 'postgres %-8s 127.0.0.1:%s down\n' "$role" "$port"
    else
      printf 'postgres %-8s 127.0.0.1:%s down (no data; start creates it)\n' "$role" "$port"
    fi
  done
}

pg_pause() { pg_q "$PG_REPLICA_PORT" "SELECT pg_wal_replay_pause()" >/dev/null; pg_q "$PG_REPLICA_PORT" "SELECT 'replay_paused=' || pg_is_wal_replay_paused()"; }
pg_delay() { # milliseconds [port]
  local port="${2:-$PG_REPLICA_PORT}"
  pg_q "$port" "ALTER SYSTEM SET recovery_min_apply_delay = '${1}ms'" >/dev/null
  pg_q "$port" "SELECT pg_reload_conf()" >/dev/null
  pg_q "$port" "SHOW recovery_min_apply_delay"
}
pg_resume() { pg_q "$PG_REPLICA_PORT" "SELECT pg_wal_replay_resume()" >/dev/null; pg_q "$PG_REPLICA_PORT" "SELECT 'replay_paused=' || pg_is_wal_replay_paused()"; }

# ------------------------------------------------------------------- MariaDB

my_q() { # port sql -> tab-separated, no headers
  mariadb --no-defaults --protocol=TCP -h 127.0.0.1 -P "$1" -u root --connect-timeout=5 -N -B -e "$2"
}

my_log() { echo "$1/log/mariadb.log"; }
my_cnf() { echo "$1/my.cnf"; }

# Running = the pid file names a live mariadbd started with our my.cnf.
my_pid() {
  local dir="$1" pid
  pid="$(cat "$dir/run/mariadbd.pid" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"--defaults-file=$dir/my.cnf "* ]] || return 1
  echo "$pid"
}
my_running() { my_pid "$1" >/dev/null; }
my_ready() { mariadb-admin --no-defaults --protocol=TCP -h 127.0.0.1 -P "$1" -u root --connect-timeout=2 ping >/dev/null 2>&1; }

my_write_cnf() { # dir port server_id role
  local dir="$1" port="$2" id="$3" role="$4"
  cat >"$(my_cnf "$dir")" <<EOF
# Written by shardkit scripts/replicas.sh on every start; edits are overwritten.
[mariadbd]
user = mysql
basedir = /usr
datadir = $dir/data
socket = $dir/run/mariadbd.sock
pid-file = $dir/run/mariadbd.pid
log-error = $(my_log "$dir")
port = $port
bind-address = 127.0.0.1
skip-name-resolve
character-set-server = utf8mb4
collation-server = utf8mb4_general_ci
server_id = $id
log_bin = $dir/data/binlog
log_bin_index = $dir/data/binlog.index
relay_log = $dir/data/relay
binlog_format = ROW
gtid_strict_mode = 1
log_slave_updates = 1
sync_binlog = 1
innodb_buffer_pool_size = 64M
innodb_log_file_size = 48M
performance_schema = 0
max_connections = 200
EOF
  if [ "$role" = replica ]; then
    cat >>"$(my_cnf "$dir")" <<EOF
read_only = 1
relay_log_recovery = 1
EOF
  fi
}

my_mkdirs() {
  mkdir -p "$1/data" "$1/run" "$1/log"
  chown -R mysql:mysql "$1"
  chmod 750 "$1/data"
}

my_start() { # dir port
  local dir="$1" port="$2" log i
  log="$(my_log "$dir")"
  if my_running "$dir"; then
    return 0
  fi
  rm -f "$dir/run/mariadbd.pid" "$dir/run/mariadbd.sock"
  if port_in_use "$port"; then
    die "port $port is in use by something that is not $dir"
  fi
  say "starting MariaDB $dir on port $port"
  [ -f "$log" ] || install -o mysql -g mysql -m 640 /dev/null "$log"
  setsid "$MARIADBD" --defaults-file="$(my_cnf "$dir")" </dev/null >>"$log" 2>&1 9>&- &
  local launched=$!
  for i in $(seq 1 "$TIMEOUT"); do
    if my_ready "$port"; then return 0; fi
    if ! kill -0 "$launched" 2>/dev/null && ! my_running "$dir"; then
      sleep 1
      my_running "$dir" || die "MariaDB in $dir exited while starting" "$log"
    fi
    sleep 1
  done
  die "MariaDB on port $port does not accept connections after ${TIMEOUT}s" "$log"
}

my_stop() { # dir
  local dir="$1" pid i
  pid="$(my_pid "$dir" || true)"
  if [ -n "$pid" ]; then
    say "stopping MariaDB $dir"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 "$TIMEOUT"); do
      [ -d "/proc/$pid" ] || break
      sleep 1
    done
    if [ -d "/proc/$pid" ]; then
      say "MariaDB $dir did not stop in ${TIMEOUT}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 1
    fi
  fi
  rm -f "$dir/run/mariadbd.pid" "$dir/run/mariadbd.sock"
}

my_install() { # dir port server_id role -> fresh data dir, server started
  local dir="$1" port="$2"
  my_stop "$dir"
  rm -rf "$dir"
  my_mkdirs "$dir"
  my_write_cnf "$@"
  say "mariadb-install-db into $dir/data"
  mariadb-install-db --defaults-file="$(my_cnf "$dir")" --user=mysql \
    --auth-root-authentication-method=normal --skip-test-db >"$dir/log/install.log" 2>&1 ||
    die "mariadb-install-db failed in $dir" "$dir/log/install.log" "$(my_log "$dir")"
  my_start "$dir" "$port"
  # Accounts, made over the socket as root@localhost and kept out of the binary
  # log: the primary's binlog starts empty so a replica can replay it from the
  # beginning.
  mariadb --no-defaults -S "$dir/run/mariadbd.sock" -u root -e "
    SET SESSION sql_log_bin = 0;
    CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
    GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
    CREATE USER IF NOT EXISTS '$MY_REPL_USER'@'127.0.0.1' IDENTIFIED BY '$MY_REPL_PASSWORD';
    GRANT REPLICATION SLAVE ON *.* TO '$MY_REPL_USER'@'127.0.0.1';" ||
    die "could not create the accounts in $dir" "$(my_log "$dir")"
  my_q "$port" "SELECT 1" >/dev/null || die "root@127.0.0.1 cannot log in to $dir" "$(my_log "$dir")"
}

my_create_primary() {
  my_install "$MY_PRIMARY_DIR" "$MY_PRIMARY_PORT" 1 primary
  # An id for this incarnation of the primary; a replica records the one it
  # was cloned from, so a reset primary means a rebuilt replica.
  cat /proc/sys/kernel/random/uuid >"$MY_PRIMARY_DIR/primary-id"
  touch "$MY_PRIMARY_DIR/$READY"
}

my_create_replica() {
  my_install "$MY_REPLICA_DIR" "$MY_REPLICA_PORT" 2 replica
  say "configuring MariaDB replica :$MY_REPLICA_PORT <- :$MY_PRIMARY_PORT (GTID slave_pos)"
  # Empty binlog and GTID position: replicate the primary's binlog from its start.
  my_q "$MY_REPLICA_PORT" "STOP SLAVE; RESET SLAVE ALL; RESET MASTER;
    SET GLOBAL gtid_slave_pos = '';
    CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=$MY_PRIMARY_PORT,
      MASTER_USER='$MY_REPL_USER', MASTER_PASSWORD='$MY_REPL_PASSWORD',
      MASTER_CONNECT_RETRY=1, MASTER_USE_GTID=slave_pos;
    START SLAVE;" ||
    die "could not configure the MariaDB replica" "$(my_log "$MY_REPLICA_DIR")"
  # Then (setting gtid_slave_pos above needs it) take READ_ONLY ADMIN from
  # root. ALL PRIVILEGES includes it and lets root write despite read_only=1;
  # such a write gets a replica GTID (0-2-N) and, with gtid_strict_mode, stops
  # replication at the primary's next event. Without it the replica refuses
  # writes like a real read replica. Root keeps everything else (START/STOP
  # SLAVE, SET GLOBAL read_only=0, ...).
  my_q "$MY_REPLICA_PORT" "SET SESSION sql_log_bin = 0;
    REVOKE READ_ONLY ADMIN ON *.* FROM 'root'@'127.0.0.1', 'root'@'localhost';" ||
    die "could not revoke READ_ONLY ADMIN on the replica" "$(my_log "$MY_REPLICA_DIR")"
  cp "$MY_PRIMARY_DIR/primary-id" "$MY_REPLICA_DIR/primary-id"
  touch "$MY_REPLICA_DIR/$READY"
}

my_slave_field() { # field -> value from SHOW SLAVE STATUS on the replica
  mariadb --no-defaults --protocol=TCP -h 127.0.0.1 -P "$MY_REPLICA_PORT" -u root \
    --connect-timeout=5 -B -e "SHOW SLAVE STATUS\G" 2>/dev/null |
    awk -v f="$1" -F': ' '{ k = $1; gsub(/^ +/, "", k) } k == f && !seen++ { print $2 }'
}

my_replicating() {
  [ "$(my_slave_field Slave_IO_Running)" = Yes ] && [ "$(my_slave_field Slave_SQL_Running)" = Yes ]
}

my_wait_replicating() { # seconds -> 0 when both threads run; 1 on timeout or
  local i stopped=0      # when a thread stays stopped (an error, not a retry)
  for i in $(seq 1 "$1"); do
    my_replicating && return 0
    if [ "$(my_slave_field Slave_IO_Running)" = No ] || [ "$(my_slave_field Slave_SQL_Running)" = No ]; then
      stopped=$((stopped + 1))
      [ "$stopped" -lt 3 ] || return 1
    fi
    sleep 1
  done
  return 1
}

my_up() {
  if [ ! -f "$MY_PRIMARY_DIR/$READY" ] || [ ! -f "$MY_PRIMARY_DIR/primary-id" ]; then
    my_create_primary
  fi
  my_write_cnf "$MY_PRIMARY_DIR" "$MY_PRIMARY_PORT" 1 primary
  my_start "$MY_PRIMARY_DIR" "$MY_PRIMARY_PORT"

  local rebuilt=0
  if [ ! -f "$MY_REPLICA_DIR/$READY" ]; then
    my_create_replica; rebuilt=1
  elif ! cmp -s "$MY_PRIMARY_DIR/primary-id" "$MY_REPLICA_DIR/primary-id"; then
    say "MariaDB replica was cloned from an earlier primary; rebuilding it"
    my_create_replica; rebuilt=1
  else
    my_write_cnf "$MY_REPLICA_DIR" "$MY_REPLICA_PORT" 2 replica
    my_start "$MY_REPLICA_DIR" "$MY_REPLICA_PORT"
    # Threads stopped on purpose (pause-replay) or by an error: start them.
    if ! my_replicating; then
      say "MariaDB replica threads are not both running; START SLAVE"
      my_q "$MY_REPLICA_PORT" "START SLAVE" 2>/dev/null || true
    fi
  fi
  if ! my_wait_replicating "$TIMEOUT"; then
    local err
    err="$(for f in Slave_IO_Running Slave_SQL_Running Last_IO_Error Last_SQL_Error; do
      printf '  %s: %s\n' "$f" "$(my_slave_field "$f")"; done)"
    [ "$rebuilt" = 0 ] ||
      die "MariaDB replica on $MY_REPLICA_PORT is not replicating after ${TIMEOUT}s:
$err" "$(my_log "$MY_REPLICA_DIR")" "$(my_log "$MY_PRIMARY_DIR")"
    say "MariaDB replica is not replicating; rebuilding it:"
    printf '%s\n' "$err" >&2
    my_create_replica
    my_wait_replicating "$TIMEOUT" ||
      die "MariaDB replica on $MY_REPLICA_PORT is not replicating after ${TIMEOUT}s" \
        "$(my_log "$MY_REPLICA_DIR")" "$(my_log "$MY_PRIMARY_DIR")"
  fi
  say "MariaDB primary :$MY_PRIMARY_PORT -> replica :$MY_REPLICA_PORT replicating"
}

my_down() {
  my_stop "$MY_REPLICA_DIR"
  my_stop "$MY_PRIMARY_DIR"
}

my_status() {
  local role dir port f
  for role in primary replica; do
    if [ "$role" = primary ]; then dir="$MY_PRIMARY_DIR"; port="$MY_PRIMARY_PORT"
    else dir="$MY_REPLICA_DIR"; port="$MY_REPLICA_PORT"; fi
    if my_running "$dir" && my_ready "$port"; then
      printf 'mariadb  %-8s 127.0.0.1:%s up\n' "$role" "$port"
      my_q "$port" "SELECT CONCAT('  server_id=', @@server_id, ' read_only=', @@read_only,
          ' gtid_binlog_pos=', @@gtid_binlog_pos, ' gtid_slave_pos=', @@gtid_slave_pos)" || true
      if [ "$role" = replica ]; then
        for f in Slave_IO_Running Slave_SQL_Running Seconds_Behind_Master Using_Gtid \
          Gtid_IO_Pos Last_IO_Error Last_SQL_Error; do
          printf '  %s: %s\n' "$f" "$(my_slave_field "$f")"
        done
      fi
    elif [ -d "$dir/data" ]; then
      printf 'mariadb  %-8s 127.0.0.1:%s down\n' "$role" "$port"
    else
      printf 'mariadb  %-8s 127.0.0.1:%s down (no data; start creates it)\n' "$role" "$port"
    fi
  done
}

my_pause() { my_q "$MY_REPLICA_PORT" "STOP SLAVE SQL_THREAD"; printf 'Slave_SQL_Running=%s\n' "$(my_slave_field Slave_SQL_Running)"; }
my_delay() { # whole seconds
  my_q "$MY_REPLICA_PORT" "STOP SLAVE"
  my_q "$MY_REPLICA_PORT" "CHANGE MASTER TO MASTER_DELAY = $1"
  my_q "$MY_REPLICA_PORT" "START SLAVE"
  printf 'SQL_Delay=%s\n' "$(my_slave_field SQL_Delay)"
}
my_resume() { my_q "$MY_REPLICA_PORT" "START SLAVE SQL_THREAD"; printf 'Slave_SQL_Running=%s\n' "$(my_slave_field Slave_SQL_Running)"; }

# --------------------------------------------------------------------- main

print_env() {
  cat <<EOF
export SHARDKIT_PG_PRIMARY_URL=postgres://postgres@127.0.0.1:$PG_PRIMARY_PORT
export SHARDKIT_PG_REPLICA_URL=postgres://postgres@127.0.0.1:$PG_REPLICA_PORT
export SHARDKIT_PG_REPLICA2_URL=postgres://postgres@127.0.0.1:$PG_REPLICA2_PORT
export SHARDKIT_MYSQL_PRIMARY_URL=mysql://root@127.0.0.1:$MY_PRIMARY_PORT
export SHARDKIT_MYSQL_REPLICA_URL=mysql://root@127.0.0.1:$MY_REPLICA_PORT
EOF
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

which_db() {
  case "${1:-}" in
    pg | postgres | postgresql) echo pg ;;
    mariadb | mysql) echo mariadb ;;
    *) say "expected pg or mariadb"; exit 2 ;;
  esac
}

cmd="${1:-}"
case "$cmd" in
  start)
    need_root; take_lock
    [ -x "$PG_BIN/postgres" ] || die "no PostgreSQL server binaries in ${PG_BIN:-/usr/lib/postgresql/*/bin}"
    [ -x "$MARIADBD" ] || die "no $MARIADBD"
    t0=$(date +%s)
    pg_up
    my_up
    # An apply delay an interrupted test left behind would slow every
    # later scenario: replicas start without one.
    pg_delay 0 >/dev/null
    pg_delay 0 "$PG_REPLICA2_PORT" >/dev/null
    my_delay 0 >/dev/null
    say "all up in $(($(date +%s) - t0))s"
    print_env
    ;;
  stop)
    need_root; take_lock
    pg_down
    my_down
    ;;
  status)
    pg_status
    my_status
    ;;
  reset)
    need_root; take_lock
    pg_down
    my_down
    say "deleting $PG_PRIMARY_DIR $PG_REPLICA_DIR $PG_REPLICA2_DIR $MY_PRIMARY_DIR $MY_REPLICA_DIR"
    rm -rf "$PG_PRIMARY_DIR" "$PG_REPLICA_DIR" "$PG_REPLICA2_DIR" "$MY_PRIMARY_DIR" "$MY_REPLICA_DIR"
    ;;
  env)
    print_env
    ;;
  pause-replay)
    case "$(which_db "${2:-}")" in pg) pg_pause ;; mariadb) my_pause ;; esac
    ;;
  resume-replay)
    case "$(which_db "${2:-}")" in pg) pg_resume ;; mariadb) my_resume ;; esac
    ;;
  delay)
    amount="${3:-}"
    [[ "$amount" =~ ^[0-9]+$ ]] || { say "delay pg MILLISECONDS | delay mariadb SECONDS"; exit 2; }
    case "$(which_db "${2:-}")" in pg) pg_delay "$amount" ;; mariadb) my_delay "$amount" ;; esac
    ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
