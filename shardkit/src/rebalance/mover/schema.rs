//! A move's schema check: the moving tables have the same columns on its
//! sources and its target, and no column the mover's entities would not
//! copy. A migration applied to some shards and not yet to others is waited
//! for; a table with columns the entity lacks stops the move (their values
//! would not reach the target).

use crate::error::{Result, ShardError};
use crate::rebalance::db_err;
use crate::rebalance::entity::MovingTable;
use crate::rebalance::fencing::Token;
use crate::rebalance::mover::{MovePhase, MoveStatus, Rebalance};
use crate::topology::ShardId;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use std::collections::BTreeSet;
use std::time::Duration;

/// What is wrong with a moving table's columns, and whether waiting (for a
/// migration to reach every shard) can mend it.
struct Mismatch {
    reason: String,
    wait: bool,
}

impl<G> Rebalance<G> {
    /// Returns once every listed entity's table has the same columns on the
    /// move's sources and target, each of them the entity's own; waits up to
    /// `rebalance.schema_wait_ms` for a migration still under way, then
    /// stops with [`ShardError::Rebalance`] naming the table, the shards and
    /// the columns.
    pub(super) async fn schemas_agree(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
    ) -> Result<()> {
        let sources: Vec<ShardId> = self.sources(status)?.into_iter().map(|(s, _)| s).collect();
        self.tables_apart(Some(status.id), &sources, target).await?;
        let wait = self.shards.rebalance_settings().schema_wait;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Some(mismatch) = self.schema_mismatch(status, target).await? else {
                return Ok(());
            };
            if !mismatch.wait {
                self.copy_again(token, status).await?;
            }
            if !mismatch.wait || tokio::time::Instant::now() >= deadline {
                let after = if mismatch.wait {
                    format!(" (waited {wait:?}; the move resumes when run again)")
                } else {
                    String::new()
                };
                return Err(self.refuse(Some(status.id), format!("{}{after}", mismatch.reason)));
            }
            tracing::debug!(group = self.group, id = status.id, reason = %mismatch.reason, "waiting for the moving tables' columns to agree");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The same check without waiting (behind the cut-over's fence).
    pub(super) async fn schemas_agree_now(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
    ) -> Result<()> {
        match self.schema_mismatch(status, target).await? {
            None => Ok(()),
            Some(mismatch) => {
                if !mismatch.wait {
                    self.copy_again(token, status).await?;
                }
                Err(self.refuse(
                    Some(status.id),
                    format!(
                        "{}; the cut-over stopped and let the moving buckets' writes go on",
                        mismatch.reason
                    ),
                ))
            }
        }
    }

    /// A column the mover's entity lacks appeared after the copy began
    /// (a migration landed meanwhile): what was copied and replayed since
    /// lacks its values, and the change log no longer names those keys.
    /// The move goes back to copying, from the start, so that a mover
    /// whose entity has the column copies every row again.
    async fn copy_again(&self, token: &Token, status: &mut MoveStatus) -> Result<()> {
        if matches!(status.phase, MovePhase::Registered | MovePhase::Copying) {
            return Ok(());
        }
        tracing::warn!(group = self.group, id = status.id, phase = %status.phase, "a moving table gained a column the mover does not copy: the move goes back to copying");
        self.set_phase(token, status, MovePhase::Copying).await
    }

    /// Refuses a move that would copy a moving table onto itself: on
    /// MySQL/MariaDB an entity's `schema_name` names a database of the
    /// server, so when a source and the target are databases of one server,
    /// `schema.table` is the same table on both. The copy would find every
    /// row already there, and the clean-up would then delete the moved
    /// buckets' rows from it. Checked at `start` and when the copy phase
    /// begins; a move that got past it (registered by an earlier build, or
    /// by a mover that did not list the entity) leaves such a table's rows
    /// in place when it cleans up or is aborted ([`Self::share_named_tables`]).
    pub(super) async fn tables_apart(
        &self,
        id: Option<i64>,
        sources: &[ShardId],
        target: ShardId,
    ) -> Result<()> {
        // Fault injection: a move registered and run as by a build without
        // this check, for the clean-up's and the abort's own.
        #[cfg(feature = "failpoints")]
        if fail::eval("shardkit::rebalance::tables_apart_unchecked", |_| ()).is_some() {
            return Ok(());
        }
        for &source in sources.iter().filter(|s| **s != target) {
            if self.share_named_tables(id, source, target).await? {
                let (from, to) = (
                    self.shards.shard_name(source),
                    self.shards.shard_name(target),
                );
                let named = self.named_tables();
                let (what, verb) = match named.len() {
                    1 => ("entity", "would be the same table"),
                    _ => ("entities", "would each be one table"),
                };
                return Err(self.refuse(
                    id,
                    format!(
                        "{} {verb} on shards `{from}` and `{to}`: they are databases of one MySQL/MariaDB server, where a `schema_name` names a database of the server, so the move would copy the rows onto themselves and then delete them from the source; give the {what} no `schema_name` (the table is then each shard's own; its rows must first be brought into the shards' databases) or move to a shard on another server",
                        list(named.iter().map(String::as_str))
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The moving tables that name a schema, as `schema.table`.
    fn named_tables(&self) -> Vec<String> {
        self.entities
            .iter()
            .map(|e| e.table())
            .filter(|t| t.schema.is_some())
            .map(ToString::to_string)
            .collect()
    }

    /// Whether shards `a` and `b` see one table under a moving table's
    /// `schema.table`: both MySQL/MariaDB, databases of one server, and a
    /// moving table names a schema (there, a database of the server).
    pub(super) async fn share_named_tables(
        &self,
        id: Option<i64>,
        a: ShardId,
        b: ShardId,
    ) -> Result<bool> {
        let named = self.named_tables();
        let mysql = |id| self.conn(id).0.get_database_backend() == DbBackend::MySql;
        if a == b || named.is_empty() || !mysql(a) || !mysql(b) {
            return Ok(false);
        }
        self.one_mysql_server(id, a, b, &named[0]).await
    }

    /// Whether MySQL/MariaDB shards `a` and `b` are databases of one server:
    /// a named lock taken on a connection of `a` (`GET_LOCK`, server-wide)
    /// is seen in use from `b` only when they share the server. Asked of
    /// the servers, not read off the URLs (aliases, proxies). The lock's
    /// name is new each time; it goes with the connection if the process
    /// dies, and stays with the pooled connection until it closes if a
    /// step timeout cuts the check short (no one asks for that name again).
    /// A lock that is not granted fails the check: the move does not go on
    /// without an answer.
    async fn one_mysql_server(
        &self,
        id: Option<i64>,
        a: ShardId,
        b: ShardId,
        table: &str,
    ) -> Result<bool> {
        use sea_orm::TransactionTrait;
        let (a_name, b_name) = (self.shards.shard_name(a), self.shards.shard_name(b));
        let lock = format!("shardkit-server-{}", uuid::Uuid::new_v4().simple());
        let sql = |sql: &str| {
            Statement::from_sql_and_values(DbBackend::MySql, sql, [lock.clone().into()])
        };
        let err = |shard: &str| {
            let shard = shard.to_owned();
            move |e| db_err(&shard, table, "identify the server of", e)
        };
        let int = |row: Option<sea_orm::QueryResult>, shard: &str, column: &str| {
            row.map(|row| row.try_get::<Option<i64>>("", column))
                .transpose()
                .map(Option::flatten)
                .map_err(err(shard))
        };
        // A transaction keeps the lock's connection for the check: one of
        // the shard's pool, as a side connection never waits for another.
        let held = self
            .timed(a_name, async {
                self.shards.shard_conn(a).begin().await.map_err(err(a_name))
            })
            .await?;
        let got = self
            .timed(a_name, async {
                let row = held
                    .query_one_raw(sql("SELECT GET_LOCK(?, 0) AS got"))
                    .await;
                int(row.map_err(err(a_name))?, a_name, "got")
            })
            .await?;
        if got != Some(1) {
            return Err(self.refuse(
                id,
                format!(
                    "could not tell whether shards `{a_name}` and `{b_name}` are databases of one server, which decides whether {table} is one table on both: a named lock on `{a_name}` was not granted (GET_LOCK answered {})",
                    got.map_or("NULL".to_owned(), |g| g.to_string())
                ),
            ));
        }
        let used = self
            .timed(b_name, async {
                let row = self
                    .conn(b)
                    .0
                    .query_one_raw(sql("SELECT IS_USED_LOCK(?) IS NOT NULL AS used"))
                    .await;
                int(row.map_err(err(b_name))?, b_name, "used")
            })
            .await?;
        self.timed(a_name, async {
            held.query_one_raw(sql("SELECT RELEASE_LOCK(?) AS released"))
                .await
                .map_err(err(a_name))?;
            held.commit().await.map_err(err(a_name))
        })
        .await?;
        Ok(used == Some(1))
    }

    async fn schema_mismatch(
        &self,
        status: &MoveStatus,
        target: ShardId,
    ) -> Result<Option<Mismatch>> {
        let mut shards: Vec<ShardId> = self.sources(status)?.into_iter().map(|(s, _)| s).collect();
        shards.push(target);
        for entity in &self.entities {
            let columns = entity.columns();
            if columns.is_empty() {
                continue;
            }
            let table = entity.table();
            let mut seen: Option<(&str, BTreeSet<String>)> = None;
            for shard in &shards {
                let (db, name) = self.conn(*shard);
                let have = self.timed(name, table_columns(db, name, table)).await?;
                let expected: BTreeSet<String> = columns
                    .iter()
                    .map(|c| match db.get_database_backend() {
                        DbBackend::Postgres => (*c).to_owned(),
                        _ => c.to_lowercase(),
                    })
                    .collect();
                let lacks: Vec<&str> = expected
                    .iter()
                    .filter(|c| !have.contains(*c))
                    .map(String::as_str)
                    .collect();
                if !lacks.is_empty() {
                    return Ok(Some(Mismatch {
                        reason: format!(
                            "table `{table}` on shard `{name}` lacks column(s) {} that the mover's entity has: migrate the shard",
                            list(lacks)
                        ),
                        wait: true,
                    }));
                }
                if let Some((other, cols)) = &seen
                    && *cols != have
                {
                    let extra: Vec<&str> = have
                        .symmetric_difference(cols)
                        .map(String::as_str)
                        .collect();
                    return Ok(Some(Mismatch {
                        reason: format!(
                            "table `{table}` has different columns on shards `{other}` and `{name}` ({}): a migration has reached one and not the other",
                            list(extra)
                        ),
                        wait: true,
                    }));
                }
                let unknown: Vec<&str> = have
                    .iter()
                    .filter(|c| !expected.contains(*c))
                    .map(String::as_str)
                    .collect();
                if !unknown.is_empty() {
                    return Ok(Some(Mismatch {
                        reason: format!(
                            "table `{table}` on shard `{name}` has column(s) {} that the mover's entity lacks, so their values would not be copied: run the move from a build whose entity has them",
                            list(unknown)
                        ),
                        wait: false,
                    }));
                }
                if seen.is_none() {
                    seen = Some((name, have));
                }
            }
        }
        Ok(None)
    }
}

fn list<'a>(columns: impl IntoIterator<Item = &'a str>) -> String {
    columns
        .into_iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The columns `table` has on `db` (none when it does not exist), by name,
/// lower-cased where the database compares names without case (MySQL,
/// MariaDB, SQLite); a MySQL invisible column (a generated invisible
/// primary key) is not one the application writes, and is left out.
async fn table_columns(
    db: &DatabaseConnection,
    shard: &str,
    table: &MovingTable,
) -> Result<BTreeSet<String>> {
    let backend = db.get_database_backend();
    // In the entity's schema when it names one; otherwise the table an
    // unqualified name in a statement finds (the search path, the
    // connection's database, SQLite's temp, main and attached databases).
    let sql = match backend {
        DbBackend::Sqlite => "SELECT name FROM pragma_table_info(?2, ?1)",
        DbBackend::Postgres => {
            "SELECT attname::text AS name FROM pg_attribute \
             WHERE attrelid = to_regclass(COALESCE(quote_ident($1) || '.', '') || quote_ident($2)) \
             AND attnum > 0 AND NOT attisdropped"
        }
        _ => {
            "SELECT CAST(column_name AS CHAR) AS name FROM information_schema.columns \
             WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? \
             AND COALESCE(extra, '') NOT LIKE '%INVISIBLE%'"
        }
    };
    let values = [table.schema.clone().into(), table.name.into()];
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(backend, sql, values))
        .await
        .map_err(|e| db_err(shard, &table.to_string(), "read the columns of", e))?;
    rows.iter()
        .map(|row| {
            row.try_get::<String>("", "name")
                .map(|name| match backend {
                    DbBackend::Postgres => name,
                    _ => name.to_lowercase(),
                })
                .map_err(|e| db_err(shard, &table.to_string(), "read the columns of", e))
        })
        .collect::<std::result::Result<_, ShardError>>()
}
