//! Fencing tokens: every write a mover makes on a shard is refused by that
//! shard, in the write's own transaction, once a newer mover took the move
//! over.
//!
//! A mover's hold on a move (`shardkit_moves.runner`, `lease_ms`) is a
//! lease: a mover that is paused (a long GC pause, a VM stall, a stopped
//! process) does not know that its hold lapsed and another process took the
//! move over. So the hold alone cannot keep its late writes out. Every
//! take-over raises the move's generation on the control database
//! (`shardkit_moves.generation`), and the new mover installs that
//! generation on every shard the move touches (`shardkit_move_fences`)
//! before it writes anything there. Each write transaction of a mover reads
//! its move's fence row on the shard first, under a shared lock held to its
//! end, and goes on only when the row holds its own generation. Installing
//! a generation waits for the transactions holding that lock, so a write of
//! the older mover either commits before the newer mover's first write
//! there (which then redoes its work from the stored position) or is
//! refused, nothing written.

use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::rebalance::db_err;
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement,
};
use std::time::Duration;

/// Each move's generation on each shard it touches.
pub(crate) const FENCES: &str = "shardkit_move_fences";

/// A mover's hold on one move: the move and the generation it took it at.
pub(crate) struct Token {
    group: &'static str,
    id: i64,
    generation: i64,
    /// How long a mover's transaction may sit idle before the server ends
    /// it (a paused mover must not hold its locks past its hold).
    idle: Duration,
    /// What a parking failpoint's argument is matched against: the move's
    /// target database.
    #[cfg(feature = "failpoints")]
    scope: String,
    /// Parked at a failpoint: a paused process, which renews nothing.
    #[cfg(feature = "failpoints")]
    parked: std::sync::atomic::AtomicBool,
    /// How many times each parking failpoint matched this mover (for
    /// `#<n>`: park at the `n`-th).
    #[cfg(feature = "failpoints")]
    matched: std::sync::Mutex<std::collections::HashMap<String, u32>>,
    /// Where the statements sent outside SeaORM are reported (the
    /// `on_statement` observer and the statement metrics).
    shards: Shards,
}

impl Token {
    pub(crate) fn new(
        shards: &Shards,
        group: &'static str,
        id: i64,
        generation: i64,
        target: ShardId,
        idle: Duration,
    ) -> Self {
        #[cfg(not(feature = "failpoints"))]
        let _ = target;
        Token {
            group,
            id,
            generation,
            idle,
            #[cfg(feature = "failpoints")]
            scope: shards.topology().shard(target).url.expose().to_owned(),
            #[cfg(feature = "failpoints")]
            parked: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "failpoints")]
            matched: std::sync::Mutex::default(),
            shards: shards.for_task(),
        }
    }

    /// Runs `work`, statement `sql` of this mover sent on a sqlx
    /// connection of shard `shard` (a `COPY` and its upsert), and reports
    /// it as SeaORM reports its own: to the `on_statement` observer and the
    /// statement metrics, with how long it took and whether it failed.
    pub(crate) async fn observed<T, E>(
        &self,
        shard: &str,
        sql: &str,
        work: impl std::future::Future<Output = std::result::Result<T, E>>,
    ) -> std::result::Result<T, E> {
        let started = std::time::Instant::now();
        let done = work.await;
        let (elapsed, failed) = (started.elapsed(), done.is_err());
        crate::metrics::ShardMetrics::new(shard).record(sql, elapsed, failed);
        self.shards.observe(
            shard,
            &Statement::from_string(DbBackend::Postgres, sql),
            elapsed,
            failed,
        );
        done
    }

    /// The move.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// Whether the mover is parked at a failpoint (always `false` without
    /// the `failpoints` feature).
    pub(crate) fn parked(&self) -> bool {
        #[cfg(feature = "failpoints")]
        return self.parked.load(std::sync::atomic::Ordering::Acquire);
        #[cfg(not(feature = "failpoints"))]
        false
    }

    /// The generation this mover holds the move at.
    pub(crate) fn generation(&self) -> i64 {
        self.generation
    }

    fn taken_over(&self, shard: &str, theirs: Option<i64>) -> ShardError {
        let reason = match theirs {
            Some(g) => format!(
                "another process took the move over (generation {g} on shard `{shard}`, this mover's is {}): this mover stops, and its write there was not made",
                self.generation
            ),
            None => format!(
                "shard `{shard}` holds no fence of this move for generation {}: this mover stops, and its write there was not made",
                self.generation
            ),
        };
        ShardError::Rebalance {
            group: self.group.to_owned(),
            id: Some(self.id),
            reason,
        }
    }

    fn select(&self, backend: DbBackend, lock: &str) -> Statement {
        let (sql, lock) = match backend {
            DbBackend::Postgres => ("grp = $1 AND move_id = $2", format!(" FOR {lock}")),
            DbBackend::MySql if lock == "SHARE" => {
                ("grp = ? AND move_id = ?", " LOCK IN SHARE MODE".to_owned())
            }
            DbBackend::MySql => ("grp = ? AND move_id = ?", " FOR UPDATE".to_owned()),
            // SQLite's write transactions are serial.
            _ => ("grp = ? AND move_id = ?", String::new()),
        };
        Statement::from_sql_and_values(
            backend,
            format!("SELECT generation FROM {FENCES} WHERE {sql}{lock}"),
            [self.group.into(), self.id.into()],
        )
    }

    /// Makes this generation the one shard `db` lets write for the move.
    /// Waits (at most `wait`) for the write transactions of an older
    /// generation in flight there; refused when a newer one is installed.
    pub(crate) async fn install(
        &self,
        (db, shard): (&DatabaseConnection, &str),
        wait: Duration,
    ) -> Result<()> {
        let err = |e| db_err(shard, FENCES, "install", e);
        if db.get_database_backend() == DbBackend::Postgres {
            self.end_older_copies(db, shard).await;
        }
        let mut attempt = 0;
        loop {
            let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
            lock_wait(&txn, Some(wait)).await.map_err(err)?;
            let outcome = match self.install_in(&txn, shard).await {
                Err(e) if crate::rebalance::errors::missing_table(&e) => {
                    Err(ShardError::Rebalance {
                        group: self.group.to_owned(),
                        id: Some(self.id),
                        reason: format!(
                            "shard `{shard}` is not migrated (it has no `{FENCES}` table): run `migrate` (`shardctl migrate`), then run the move again"
                        ),
                    })
                }
                other => other,
            };
            reset_lock_wait(&txn, Some(wait)).await.map_err(err)?;
            match outcome {
                Ok(()) => return txn.commit().await.map_err(err),
                // Another mover inserted the row first: read it again.
                Err(e) if attempt == 0 && unique(&e) => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    async fn install_in(&self, txn: &DatabaseTransaction, shard: &str) -> Result<()> {
        let err = |e| db_err(shard, FENCES, "install", e);
        let now = txn
            .query_one_raw(self.select(txn.get_database_backend(), "UPDATE"))
            .await
            .map_err(err)?
            .map(|row| row.try_get::<i64>("", "generation"))
            .transpose()
            .map_err(err)?;
        match now {
            Some(g) if g > self.generation => Err(self.taken_over(shard, Some(g))),
            Some(_) => {
                let stmt = Query::update()
                    .table(Alias::new(FENCES))
                    .value(Alias::new("generation"), self.generation)
                    .and_where(Expr::col(Alias::new("grp")).eq(self.group))
                    .and_where(Expr::col(Alias::new("move_id")).eq(self.id))
                    .to_owned();
                txn.execute(&stmt).await.map(drop).map_err(err)
            }
            None => {
                let stmt = Query::insert()
                    .into_table(Alias::new(FENCES))
                    .columns(["grp", "move_id", "generation"].map(Alias::new))
                    .values_panic([self.group.into(), self.id.into(), self.generation.into()])
                    .to_owned();
                txn.execute(&stmt).await.map(drop).map_err(err)
            }
        }
    }

    /// Begins a write transaction of this mover on `db`: refused (nothing
    /// written) once a newer mover took the move over. `what` names the
    /// write, for the parking failpoints.
    pub(crate) async fn begin(
        &self,
        (db, shard): (&DatabaseConnection, &str),
        what: &str,
    ) -> Result<DatabaseTransaction> {
        self.park("park", what).await;
        let err = |e| db_err(shard, FENCES, "check", e);
        let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
        let backend = txn.get_database_backend();
        if let Some(set) = self.idle_bound(backend) {
            txn.execute_unprepared(&set).await.map_err(err)?;
        }
        let now = txn
            .query_one_raw(self.select(backend, "SHARE"))
            .await
            .map_err(err)?
            .map(|row| row.try_get::<i64>("", "generation"))
            .transpose()
            .map_err(err)?;
        if now != Some(self.generation) {
            let _ = txn.rollback().await;
            return Err(self.taken_over(shard, now));
        }
        // A paused process inside its transaction, holding the fence's lock.
        self.park("park_open", what).await;
        Ok(txn)
    }

    /// The statement that bounds how long a mover's transaction may sit
    /// idle on `backend` before the server ends it.
    fn idle_bound(&self, backend: DbBackend) -> Option<String> {
        let idle = self.idle.as_millis().max(1000);
        match backend {
            DbBackend::Postgres => Some(format!(
                "SET LOCAL idle_in_transaction_session_timeout = '{idle}ms'"
            )),
            // MariaDB only (MySQL reads the comment as a comment).
            DbBackend::MySql => Some(format!(
                "SET SESSION /*M!100300 idle_transaction_timeout = {}, */ innodb_lock_wait_timeout = {}",
                idle.div_ceil(1000),
                crate::exec::SIDE_LOCK_WAIT_SECS
            )),
            _ => None,
        }
    }

    /// [`Token::begin`] on a sqlx connection of a shard's PostgreSQL pool, for
    /// a statement SeaORM's transaction cannot carry (`COPY … FROM STDIN`,
    /// see [`pg_copy`](super::pg_copy)): the same idle bound, the same
    /// fence read under a shared lock, the same parking points.
    pub(crate) async fn begin_pg<'c>(
        &self,
        conn: &'c mut sea_orm::sqlx::PgConnection,
        shard: &str,
        what: &str,
    ) -> Result<sea_orm::sqlx::Transaction<'c, sea_orm::sqlx::Postgres>> {
        use sea_orm::sqlx;
        self.park("park", what).await;
        let err = |e: sqlx::Error| db_err(shard, FENCES, "check", super::errors::sqlx_err(e));
        let mut txn = sqlx::Connection::begin(conn).await.map_err(err)?;
        // The idle bound does not cover a `COPY` waiting for its data (the
        // server holds cancels there), so the session is named for the
        // move and generation: a mover that takes the move over ends it
        // ([`Token::end_older_copies`]).
        let idle = self.idle_bound(DbBackend::Postgres).unwrap_or_default();
        let name = session_name(self.id, self.generation, self.group);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "{idle}; SET LOCAL application_name = '{name}'"
        )))
        .execute(&mut *txn)
        .await
        .map_err(err)?;
        // The fence read as `begin` sends it, its values bound here.
        let select = self.select(DbBackend::Postgres, "SHARE").sql;
        let now: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(select))
            .bind(self.group)
            .bind(self.id)
            .fetch_optional(&mut *txn)
            .await
            .map_err(err)?;
        if now == Some(self.generation) {
            // A paused process inside its transaction, holding the fence's
            // lock.
            self.park("park_open", what).await;
            return Ok(txn);
        }
        let _ = txn.rollback().await;
        Err(self.taken_over(shard, now))
    }

    /// On a PostgreSQL shard, before this mover's fence goes in: ends the
    /// sessions of older generations of this move that are in, or
    /// stopped after, a `COPY`. A mover paused while sending a `COPY`'s
    /// data holds the fence's shared lock, and neither the idle bound nor a
    /// statement timeout ends a `COPY` waiting for its data; its hold has
    /// lapsed (that is why this mover took over), so its transaction is
    /// one the fence would refuse anyway. Best effort: without the right
    /// to end another session, the install waits as before.
    async fn end_older_copies(&self, db: &DatabaseConnection, shard: &str) {
        let prefix = format!("shardkit move {}.", self.id);
        let stmt = Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT pid, application_name FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND starts_with(application_name, $1) AND starts_with(query, 'COPY ')",
            [prefix.clone().into()],
        );
        let rows = match db.query_all_raw(stmt).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(shard, error = %e, "could not list an older mover's COPY sessions");
                return;
            }
        };
        for row in rows {
            let (Ok(pid), Ok(name)) = (
                row.try_get::<i32>("", "pid"),
                row.try_get::<String>("", "application_name"),
            ) else {
                continue;
            };
            let older = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.split_once(' '))
                .and_then(|(g, group)| Some((g.parse::<i64>().ok()?, group)))
                .is_some_and(|(g, group)| {
                    g < self.generation && !group.is_empty() && self.group.starts_with(group)
                });
            if !older {
                continue;
            }
            let end = Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT pg_terminate_backend($1)",
                [pid.into()],
            );
            match db.execute_raw(end).await {
                Ok(_) => tracing::warn!(
                    group = self.group,
                    id = self.id,
                    generation = self.generation,
                    shard,
                    pid,
                    "ended the COPY of an older mover of this move"
                ),
                Err(e) => tracing::warn!(
                    shard,
                    pid,
                    error = %e,
                    "could not end an older mover's COPY: the install waits for it"
                ),
            }
        }
    }

    /// A paused process in the middle of sending a `COPY`'s data (see
    /// [`Token::park`]).
    pub(crate) async fn park_sending(&self, what: &str) {
        self.park("park_sending", what).await;
    }

    /// Fault injection: `shardkit::rebalance::park::<what>` parks the mover
    /// before that write (`park_open::<what>`: inside its transaction, the
    /// fence's lock held; `park_sending::<what>`: between two sends of a
    /// `COPY`'s data), for as long as the failpoint's argument is part
    /// of the target database's URL (any move, without one); `<part>@<n>`
    /// parks only the mover holding generation `n`, and a further `#<k>`
    /// from that mover's `k`-th such write on (a count of the failpoint's
    /// own, `2*off->...`, would be used up by every mover of the process).
    /// It evaluates `shardkit::rebalance::parked` once when it parks.
    #[allow(unused_variables)]
    async fn park(&self, kind: &str, what: &str) {
        #[cfg(feature = "failpoints")]
        {
            let name = format!("shardkit::rebalance::{kind}::{what}");
            let mut nth = 1;
            let here = |nth: &mut u32| {
                fail::eval(&name, |arg| arg.unwrap_or_default()).is_some_and(|arg| {
                    // `#<k>` and `@<n>` only as numbers: a path's own `#`
                    // or `@` stays part of the scope.
                    let (arg, k) = arg
                        .rsplit_once('#')
                        .and_then(|(rest, k)| Some((rest.to_owned(), k.parse::<u32>().ok()?)))
                        .unwrap_or((arg, 1));
                    *nth = k;
                    let (scope, generation) = match arg.rsplit_once('@') {
                        Some((scope, g)) => match g.parse::<i64>() {
                            Ok(g) => (scope.to_owned(), Some(g)),
                            Err(_) => (arg, None),
                        },
                        None => (arg, None),
                    };
                    self.scope.contains(scope.as_str())
                        && generation.is_none_or(|g| g == self.generation)
                })
            };
            if !here(&mut nth) {
                return;
            }
            let times = {
                let mut matched = self.matched.lock().unwrap_or_else(|e| e.into_inner());
                let times = matched.entry(name.clone()).or_default();
                *times += 1;
                *times
            };
            if times < nth {
                return;
            }
            tracing::warn!(
                group = self.group,
                id = self.id,
                generation = self.generation,
                what,
                "mover parked at a failpoint"
            );
            self.parked
                .store(true, std::sync::atomic::Ordering::Release);
            fail::eval("shardkit::rebalance::parked", |_| ());
            while here(&mut nth) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            self.parked
                .store(false, std::sync::atomic::Ordering::Release);
        }
    }
}

fn unique(e: &ShardError) -> bool {
    matches!(e, ShardError::Db { source, .. } if crate::error::is_unique_violation(source))
}

/// Begins a write transaction on `db` under `token` when there is one.
pub(crate) async fn begin_fenced(
    token: Option<&Token>,
    (db, shard): (&DatabaseConnection, &str),
    what: &str,
    table: &str,
) -> Result<DatabaseTransaction> {
    match token {
        Some(token) => token.begin((db, shard), what).await,
        None => crate::exec::begin_pooled(db)
            .await
            .map_err(|e| db_err(shard, table, "begin", e)),
    }
}

/// Makes the transaction's statements wait at most `wait` for row locks
/// (PostgreSQL's `lock_timeout`, MySQL's lock wait timeout in whole
/// seconds); nothing without one.
pub(crate) async fn lock_wait(
    txn: &DatabaseTransaction,
    wait: Option<Duration>,
) -> std::result::Result<(), DbErr> {
    let Some(wait) = wait else { return Ok(()) };
    let ms = wait.as_millis().max(1);
    let set = match txn.get_database_backend() {
        DbBackend::Postgres => format!("SET LOCAL lock_timeout = '{ms}ms'"),
        // MySQL counts whole seconds (at least 1).
        DbBackend::MySql => format!(
            "SET SESSION innodb_lock_wait_timeout = {}",
            ms.div_ceil(1000).max(1)
        ),
        _ => return Ok(()),
    };
    txn.execute_unprepared(&set).await.map(drop)
}

/// After [`lock_wait`]: the connection goes back to the side pool with its
/// own lock wait again (a MySQL session setting outlives the transaction).
pub(crate) async fn reset_lock_wait(
    txn: &DatabaseTransaction,
    wait: Option<Duration>,
) -> std::result::Result<(), DbErr> {
    if wait.is_some() && txn.get_database_backend() == DbBackend::MySql {
        txn.execute_unprepared(crate::exec::SIDE_MYSQL_SESSION)
            .await?;
    }
    Ok(())
}

/// The `application_name` of move `id`'s `COPY` sessions at `generation`:
/// the generation before the group, so that the server's cut at 63 bytes
/// only shortens the group (cut here the same way, at a character's end).
/// Group names are Rust identifiers: nothing to quote.
fn session_name(id: i64, generation: i64, group: &str) -> String {
    let mut name = format!("shardkit move {id}.{generation} {group}");
    let end = (0..=name.len().min(63))
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    name.truncate(end);
    name
}

#[cfg(test)]
mod tests {
    #[test]
    fn session_names_are_cut_at_63_bytes_on_a_character() {
        assert_eq!(
            super::session_name(7, 2, "Customer"),
            "shardkit move 7.2 Customer"
        );
        let long = "Ünïcödé".repeat(10);
        let name = super::session_name(123, 4, &long);
        assert!(name.len() <= 63, "{name}");
        assert!(name.starts_with("shardkit move 123.4 Ü"));
        assert!(long.starts_with(name.strip_prefix("shardkit move 123.4 ").unwrap()));
    }
}
