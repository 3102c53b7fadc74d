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

    /// Refuses a move that would copy a moving table onto itself: a source
    /// and the target that reach one table under a moving table's name (see
    /// [`Self::shared_tables`]). The copy would find every row already there,
    /// and the clean-up would then delete the moved buckets' rows from it.
    /// Checked at `start` and when the copy phase begins; a move that got
    /// past it (registered by an earlier build, or by a mover that did not
    /// list the entity) leaves such a table's rows in place when it cleans
    /// up or is aborted.
    pub(super) async fn tables_apart(
        &self,
        id: Option<i64>,
        sources: &[ShardId],
        target: ShardId,
    ) -> Result<()> {
        // Fault injection: a move registered and run as by a build without
        // this check, for the clean-up's and the abort's own (a move to the
        // target whose URL holds the failpoint's argument).
        #[cfg(feature = "failpoints")]
        if self.fires("shardkit::rebalance::tables_apart_unchecked", target) {
            return Ok(());
        }
        for &source in sources.iter().filter(|s| **s != target) {
            let Some((why, tables)) = self.shared_tables(id, source, target).await? else {
                continue;
            };
            let names: Vec<String> = tables.iter().map(ToString::to_string).collect();
            let (from, to) = (
                self.shards.shard_name(source),
                self.shards.shard_name(target),
            );
            let verb = match tables.len() {
                1 => "would be the same table",
                _ => "would each be one table",
            };
            return Err(self.refuse(
                id,
                format!(
                    "{} {verb} on shards `{from}` and `{to}`: {}, so the move would copy the rows onto themselves and then delete them from the source; {}",
                    list(names.iter().map(String::as_str)),
                    why.reason(),
                    why.remedy(tables.len() > 1),
                ),
            ));
        }
        Ok(())
    }

    /// The moving tables that are one table on shards `a` and `b`, and why;
    /// `None` when each has its own. Asked of the databases, not read off
    /// the URLs (aliases, proxies, a path spelled two ways):
    /// - MySQL/MariaDB: a named lock taken on `a` (`GET_LOCK`, server-wide)
    ///   is seen in use from `b` only when they share the server. There a
    ///   `schema_name` names a database of the server, so such a table is
    ///   one table; the others are when both connect to one database.
    /// - PostgreSQL: an advisory lock taken on `a` is seen in `b`'s
    ///   `pg_locks` row for its own database only when both are one
    ///   database (shards that are schemas of one database, each with its
    ///   search path); then a table is one table when its name finds the
    ///   same relation on both.
    /// - SQLite: the database file a table's name finds is one file.
    pub(super) async fn shared_tables(
        &self,
        id: Option<i64>,
        a: ShardId,
        b: ShardId,
    ) -> Result<Option<(OneTable, Vec<MovingTable>)>> {
        let tables: Vec<&MovingTable> = self.entities.iter().map(|e| e.table()).collect();
        let backend = |id| self.conn(id).0.get_database_backend();
        if a == b || tables.is_empty() || backend(a) != backend(b) {
            return Ok(None);
        }
        let first = tables[0].to_string();
        let (why, shared): (OneTable, Vec<&MovingTable>) = match backend(a) {
            DbBackend::MySql => {
                if !self.lock_seen(id, a, b, &first).await? {
                    return Ok(None);
                }
                let (da, fold) = self.mysql_database(a, &first).await?;
                let (db, _) = self.mysql_database(b, &first).await?;
                // Names compare as the server compares them.
                if da == db || (fold && da.eq_ignore_ascii_case(&db)) {
                    (OneTable::Database, tables)
                } else {
                    let named = tables.into_iter().filter(|t| t.schema.is_some()).collect();
                    (OneTable::MySqlServer, named)
                }
            }
            DbBackend::Postgres => {
                let Some((oa, ob)) = self.one_pg_database(id, a, b, &tables).await? else {
                    return Ok(None);
                };
                let shared: Vec<&MovingTable> = tables
                    .iter()
                    .zip(oa.iter().zip(&ob))
                    .filter(|(_, (x, y))| x.is_some() && x == y)
                    .map(|(t, _)| *t)
                    .collect();
                let why = if shared.iter().any(|t| t.schema.is_none()) {
                    OneTable::PgSearchPath
                } else {
                    OneTable::PgSchemas
                };
                (why, shared)
            }
            _ => {
                let mut shared = Vec::new();
                for table in tables {
                    let (fa, fb) = (
                        self.sqlite_file(id, a, table).await?,
                        self.sqlite_file(id, b, table).await?,
                    );
                    if fa.is_some() && fa == fb {
                        shared.push(table);
                    }
                }
                (OneTable::Database, shared)
            }
        };
        if shared.is_empty() {
            return Ok(None);
        }
        Ok(Some((why, shared.into_iter().cloned().collect())))
    }

    /// Whether a lock taken on shard `a` is seen from shard `b`: it
    /// holds the lock in a transaction of `a`'s pool (so the lock keeps its
    /// connection), then `b` is asked whether it sees it. A lock that is not
    /// granted fails the check: the move does not go on without an answer.
    ///
    /// - MySQL/MariaDB (seen: the same server): a named lock (`GET_LOCK`,
    ///   server-wide), seen in use from `b` only when they share the server.
    ///   Its name is new each time; it goes with the connection if the
    ///   process dies, and stays with the pooled connection until it closes
    ///   if a step timeout cuts the check short (no one asks for that name
    ///   again).
    /// - PostgreSQL (seen: the same database): an advisory lock of new keys, listed
    ///   in `pg_locks` under `a`'s database; `b` looks for it under its own.
    ///   It ends with the transaction, or with the connection.
    async fn lock_seen(
        &self,
        id: Option<i64>,
        a: ShardId,
        b: ShardId,
        table: &str,
    ) -> Result<bool> {
        let (a_name, b_name) = (self.shards.shard_name(a), self.shards.shard_name(b));
        let backend = self.conn(a).0.get_database_backend();
        let [take, look, release, what, lock] = match backend {
            DbBackend::MySql => [
                "SELECT GET_LOCK(?, 0) AS got",
                "SELECT IS_USED_LOCK(?) IS NOT NULL AS seen",
                "SELECT RELEASE_LOCK(?) AS released",
                "databases of one server",
                "a named lock",
            ],
            _ => [
                "SELECT pg_try_advisory_xact_lock($1, $2)::int::bigint AS got",
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 2)::int::bigint AS seen",
                "",
                "one database",
                "an advisory lock",
            ],
        };
        // The lock's name, or its two keys (non-negative `int4`s).
        let values: Vec<sea_orm::Value> = match backend {
            DbBackend::MySql => {
                vec![format!("shardkit-server-{}", uuid::Uuid::new_v4().simple()).into()]
            }
            _ => {
                let keys = uuid::Uuid::new_v4().as_u64_pair().0;
                vec![
                    ((keys >> 33) as i32).into(),
                    ((keys & 0x7fff_ffff) as i32).into(),
                ]
            }
        };
        let sql = |sql: &str| Statement::from_sql_and_values(backend, sql, values.clone());
        let err = |shard: &str| identify_err(shard, table);
        let held = self
            .timed(a_name, async {
                crate::exec::begin_pooled_with(self.shards.shard_conn(a), Default::default())
                    .await
                    .map_err(err(a_name))
            })
            .await?;
        let got = self
            .timed(a_name, async {
                let row = held.query_one_raw(sql(take)).await;
                int(row.map_err(err(a_name))?, a_name, table, "got")
            })
            .await?;
        if got != Some(1) {
            return Err(self.refuse(
                id,
                format!(
                    "could not tell whether shards `{a_name}` and `{b_name}` are {what}, which decides whether {table} is one table on both: {lock} on `{a_name}` was not granted (it answered {})",
                    got.map_or("NULL".to_owned(), |g| g.to_string())
                ),
            ));
        }
        let seen = self
            .timed(b_name, async {
                let row = self.conn(b).0.query_one_raw(sql(look)).await;
                int(row.map_err(err(b_name))?, b_name, table, "seen")
            })
            .await?;
        self.timed(a_name, async {
            if !release.is_empty() {
                held.query_one_raw(sql(release))
                    .await
                    .map_err(err(a_name))?;
            }
            held.commit().await.map_err(err(a_name))
        })
        .await?;
        Ok(seen == Some(1))
    }

    /// The database a MySQL/MariaDB shard's connections use, and whether
    /// the server compares database names without case
    /// (`lower_case_table_names` not 0).
    async fn mysql_database(&self, id: ShardId, table: &str) -> Result<(String, bool)> {
        let (db, name) = self.conn(id);
        self.timed(name, async {
            let row = db
                .query_one_raw(Statement::from_string(
                    DbBackend::MySql,
                    "SELECT DATABASE() AS db, CAST(@@lower_case_table_names AS SIGNED) AS fold",
                ))
                .await
                .map_err(identify_err(name, table))?;
            let database = row
                .as_ref()
                .map(|row| row.try_get::<Option<String>>("", "db"))
                .transpose()
                .map_err(identify_err(name, table))?
                .flatten()
                .unwrap_or_default();
            let fold = int(row, name, table, "fold")?.unwrap_or(0) != 0;
            Ok((database, fold))
        })
        .await
    }

    /// When PostgreSQL shards `a` and `b` are one database
    /// ([`Self::lock_seen`]): the relation each of `tables` finds on each
    /// (its OID, `None` when there is none).
    async fn one_pg_database(
        &self,
        id: Option<i64>,
        a: ShardId,
        b: ShardId,
        tables: &[&MovingTable],
    ) -> Result<Option<(Vec<Option<i64>>, Vec<Option<i64>>)>> {
        if !self.lock_seen(id, a, b, &tables[0].to_string()).await? {
            return Ok(None);
        }
        let mut oids = (Vec::new(), Vec::new());
        for table in tables {
            oids.0.push(self.pg_relation(a, table).await?);
            oids.1.push(self.pg_relation(b, table).await?);
        }
        Ok(Some(oids))
    }

    /// The OID of the relation `table`'s name finds on PostgreSQL shard `id`
    /// (in its schema, or by the connection's search path).
    async fn pg_relation(&self, id: ShardId, table: &MovingTable) -> Result<Option<i64>> {
        let (db, name) = self.conn(id);
        let what = table.to_string();
        self.timed(name, async {
            let row = db
                .query_one_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "SELECT to_regclass(COALESCE(quote_ident($1) || '.', '') || quote_ident($2))::oid::bigint AS oid",
                    [table.schema.clone().into(), table.name.into()],
                ))
                .await
                .map_err(identify_err(name, &what))?;
            Ok(row
                .map(|row| row.try_get::<Option<i64>>("", "oid"))
                .transpose()
                .map_err(identify_err(name, &what))?
                .flatten())
        })
        .await
    }

    /// The file of the SQLite database `table`'s name finds on shard `id`
    /// (`main`, or the attached database its schema names), as the file
    /// system identifies it; `None` for an in-memory or temporary one.
    async fn sqlite_file(
        &self,
        move_id: Option<i64>,
        id: ShardId,
        table: &MovingTable,
    ) -> Result<Option<FileId>> {
        let (db, name) = self.conn(id);
        let what = table.to_string();
        let path = self
            .timed(name, async {
                let row = db
                    .query_one_raw(Statement::from_sql_and_values(
                        DbBackend::Sqlite,
                        "SELECT file FROM pragma_database_list WHERE name = ? COLLATE NOCASE",
                        [table
                            .schema
                            .clone()
                            .unwrap_or_else(|| "main".to_owned())
                            .into()],
                    ))
                    .await
                    .map_err(identify_err(name, &what))?;
                row.map(|row| row.try_get::<Option<String>>("", "file"))
                    .transpose()
                    .map_err(identify_err(name, &what))
                    .map(Option::flatten)
            })
            .await?;
        let Some(path) = path.filter(|p| !p.is_empty()) else {
            return Ok(None);
        };
        match tokio::fs::metadata(&path).await {
            Ok(meta) => Ok(Some(FileId::of(&path, &meta))),
            // An open database whose file cannot be looked at: no answer,
            // and no answer is not "apart".
            Err(e) => Err(self.refuse(
                move_id,
                format!(
                    "could not tell whether {table} on shard `{name}` is one table with the move's other shard's: its file {path} could not be looked at: {e}"
                ),
            )),
        }
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
                let backend = db.get_database_backend();
                let expected: BTreeSet<String> = columns
                    .iter()
                    .map(|c| crate::exec::columns::named(backend, c))
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

/// The columns `table` has on `db` (see [`crate::exec::columns`]).
async fn table_columns(
    db: &DatabaseConnection,
    shard: &str,
    table: &MovingTable,
) -> Result<BTreeSet<String>> {
    crate::exec::columns::table_columns(db, table.schema.as_deref(), table.name)
        .await
        .map_err(|e| db_err(shard, &table.to_string(), "read the columns of", e))
}

/// Why two shards reach one table under a moving table's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OneTable {
    /// The two shards' URLs reach one database.
    Database,
    /// MySQL/MariaDB databases of one server, and a `schema_name`.
    MySqlServer,
    /// Schemas of one PostgreSQL database, and a `schema_name`.
    PgSchemas,
    /// One PostgreSQL database, whose search paths find one table.
    PgSearchPath,
}

impl OneTable {
    fn reason(self) -> &'static str {
        match self {
            OneTable::Database => "the two shards' URLs reach one database",
            OneTable::MySqlServer => {
                "they are databases of one MySQL/MariaDB server, where a `schema_name` names a database of the server"
            }
            OneTable::PgSchemas => {
                "they are one PostgreSQL database (each with its own search path), where a `schema_name` names the same schema for both"
            }
            OneTable::PgSearchPath => {
                "they are one PostgreSQL database, and the table each one's search path finds is the same"
            }
        }
    }

    fn remedy(self, several: bool) -> String {
        let what = if several { "entities" } else { "entity" };
        match self {
            OneTable::Database => {
                "give each shard a database of its own in the config (a shard is one database)".to_owned()
            }
            OneTable::MySqlServer => format!(
                "give the {what} no `schema_name` (the table is then each shard's own; its rows must first be brought into the shards' databases) or move to a shard on another server"
            ),
            OneTable::PgSearchPath => {
                "give each shard a database of its own in the config, or a search path whose first schema is its own and holds its tables (migrate the shard)".to_owned()
            }
            OneTable::PgSchemas => format!(
                "give the {what} no `schema_name` (the table is then the one each shard's search path finds; its rows must first be brought there) or move to a shard in another database"
            ),
        }
    }
}

/// A file as the file system identifies it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum FileId {
    #[cfg(unix)]
    Inode(u64, u64),
    #[cfg(not(unix))]
    Path(std::path::PathBuf),
}

impl FileId {
    #[cfg(unix)]
    fn of(_path: &str, meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileId::Inode(meta.dev(), meta.ino())
    }

    #[cfg(not(unix))]
    fn of(path: &str, _meta: &std::fs::Metadata) -> Self {
        FileId::Path(std::fs::canonicalize(path).unwrap_or_else(|_| path.into()))
    }
}

fn identify_err(shard: &str, table: &str) -> impl Fn(sea_orm::DbErr) -> ShardError + use<> {
    let (shard, table) = (shard.to_owned(), table.to_owned());
    move |e| db_err(&shard, &table, "identify the database of", e)
}

/// A row's integer column, `None` for no row or NULL.
fn int(
    row: Option<sea_orm::QueryResult>,
    shard: &str,
    table: &str,
    column: &str,
) -> Result<Option<i64>> {
    row.map(|row| row.try_get::<Option<i64>>("", column))
        .transpose()
        .map(Option::flatten)
        .map_err(identify_err(shard, table))
}
