//! Classifying drivers' errors by their codes: unique violations, capacity
//! refusals, SQLite's busy, missing tables, and the errors shardkit makes
//! itself ([`Synthetic`]).

use crate::error::Retry;
use sea_orm::DbErr;

/// Whether the database refused a row for a unique key it already holds.
pub(crate) fn is_unique_violation(e: &DbErr) -> bool {
    matches!(
        e.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    )
}

/// How long a caller waits before retrying after a server refused a
/// connection for having too many ([`is_capacity`]).
pub(crate) const CAPACITY_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether the server refused a connection because it has too many: it is
/// up, and answers again once others close (PostgreSQL SQLSTATE `53300`,
/// `too_many_connections`, for the server, a database or a role;
/// MySQL/MariaDB 1040, `Too many connections`, and 1203, a user's
/// `max_user_connections`). Such an error must not mark the shard down.
pub(crate) fn is_capacity(err: &DbErr) -> bool {
    use sea_orm::RuntimeErr;
    match err {
        DbErr::Conn(RuntimeErr::SqlxError(e))
        | DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e)) => sqlx_is_capacity(e),
        _ => false,
    }
}

/// [`is_capacity`] of SQLx's error (a probe's connection attempt).
pub(crate) fn sqlx_is_capacity(err: &sea_orm::sqlx::Error) -> bool {
    match err {
        sea_orm::sqlx::Error::Database(db) => database_is_capacity(&**db),
        _ => false,
    }
}

/// [`is_capacity`] of the database's own error.
pub(crate) fn database_is_capacity(db: &dyn sea_orm::sqlx::error::DatabaseError) -> bool {
    if let Some(mysql) = db.try_downcast_ref::<sea_orm::sqlx::mysql::MySqlDatabaseError>() {
        return mysql_is_capacity(mysql.number());
    }
    if db
        .try_downcast_ref::<sea_orm::sqlx::sqlite::SqliteError>()
        .is_some()
    {
        return false;
    }
    db.code().as_deref() == Some("53300")
}

/// MySQL/MariaDB's `ER_CON_COUNT_ERROR` (1040) and
/// `ER_TOO_MANY_USER_CONNECTIONS` (1203).
pub(crate) fn mysql_is_capacity(number: u16) -> bool {
    matches!(number, 1040 | 1203)
}

/// How long a caller waits before retrying after SQLite said `database is
/// locked` ([`ShardError::retry`]).
pub(crate) const SQLITE_BUSY_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// A database error shardkit makes itself, classified by its code like the
/// server's own: SQLite's `database is locked` (code 5) for a write
/// transaction that waited the whole busy timeout for the write slot the
/// cluster's SQLite files share (`crate::exec::sqlite`) and never reached
/// SQLite; with the `failpoints` feature, a statement the database aborted.
#[derive(Debug)]
pub(crate) struct Synthetic {
    code: &'static str,
    message: String,
}

impl Synthetic {
    fn db_err(code: &'static str, message: String) -> DbErr {
        DbErr::Exec(sea_orm::RuntimeErr::SqlxError(std::sync::Arc::new(
            sea_orm::sqlx::Error::Database(Box::new(Synthetic { code, message })),
        )))
    }

    /// The error of a wait of `waited` for the SQLite write slot.
    pub(crate) fn sqlite_slot(waited: std::time::Duration) -> DbErr {
        Self::db_err(
            "5",
            format!(
                "database is locked: waited {waited:?} (the busy timeout) for the write slot the \
                 cluster's SQLite files share; another write transaction, of this process or \
                 another, held it"
            ),
        )
    }

    /// A serialization failure (SQLSTATE `40001`) made up by failpoint
    /// `failpoint`.
    #[cfg(feature = "failpoints")]
    pub(crate) fn aborted(failpoint: &str) -> DbErr {
        Self::db_err(
            "40001",
            format!("could not serialize access (failpoint {failpoint})"),
        )
    }
}

impl std::fmt::Display for Synthetic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Synthetic {}

impl sea_orm::sqlx::error::DatabaseError for Synthetic {
    fn message(&self) -> &str {
        &self.message
    }
    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(self.code.into())
    }
    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }
    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }
    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }
    fn kind(&self) -> sea_orm::sqlx::error::ErrorKind {
        sea_orm::sqlx::error::ErrorKind::Other
    }
}

/// Whether the error is MySQL/MariaDB's lock wait timeout (1205): retried
/// as a transaction ([`db_retry`]), but InnoDB ends only the statement with
/// it (`innodb_rollback_on_timeout` is off by default), and a `NOWAIT` or
/// `WAIT n` lock that is refused says it too. The transaction goes on.
pub(crate) fn is_lock_wait_timeout(err: &DbErr) -> bool {
    use sea_orm::{RuntimeErr, sqlx};
    let (DbErr::Conn(RuntimeErr::SqlxError(e))
    | DbErr::Exec(RuntimeErr::SqlxError(e))
    | DbErr::Query(RuntimeErr::SqlxError(e))) = err
    else {
        return false;
    };
    match &**e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|mysql| mysql.number() == 1205),
        _ => false,
    }
}

/// Classifies a driver error by its code (see [`ShardError::retry`]).
pub(crate) fn db_retry(err: &DbErr) -> Retry {
    use sea_orm::{RuntimeErr, SqlErr, sqlx};
    if matches!(
        err.sql_err(),
        Some(SqlErr::UniqueConstraintViolation(_) | SqlErr::ForeignKeyConstraintViolation(_))
    ) {
        return Retry::Never;
    }
    if is_capacity(err) {
        return Retry::After(CAPACITY_WAIT);
    }
    let runtime = match err {
        DbErr::ConnectionAcquire(_) => return Retry::Now,
        DbErr::Conn(r) | DbErr::Exec(r) | DbErr::Query(r) => r,
        _ => return Retry::Never,
    };
    let RuntimeErr::SqlxError(sqlx_err) = runtime else {
        return Retry::Never;
    };
    match &**sqlx_err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Retry::Now,
        sqlx::Error::Database(db) => {
            if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return match mysql.number() {
                    1213 | 1205 => Retry::Transaction,
                    _ => Retry::Never,
                };
            }
            if database_is_sqlite_busy(&**db) {
                return Retry::After(SQLITE_BUSY_WAIT);
            }
            match db.code().as_deref() {
                Some("40001" | "40P01") => Retry::Transaction,
                _ => Retry::Never,
            }
        }
        _ => Retry::Never,
    }
}

/// Whether SQLite said `database is locked`: `SQLITE_BUSY` or
/// `SQLITE_LOCKED` with their extended codes (the low byte is the primary
/// code), or the cluster's write slot waited out ([`Synthetic::sqlite_slot`]).
pub(crate) fn is_sqlite_busy(err: &DbErr) -> bool {
    use sea_orm::RuntimeErr;
    match err {
        DbErr::Conn(RuntimeErr::SqlxError(e))
        | DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e)) => match &**e {
            sea_orm::sqlx::Error::Database(db) => database_is_sqlite_busy(&**db),
            _ => false,
        },
        _ => false,
    }
}

fn database_is_sqlite_busy(db: &dyn sea_orm::sqlx::error::DatabaseError) -> bool {
    if db
        .try_downcast_ref::<Synthetic>()
        .is_some_and(|s| s.code == "5")
    {
        return true;
    }
    db.try_downcast_ref::<sea_orm::sqlx::sqlite::SqliteError>()
        .is_some()
        && db
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|c| matches!(c & 0xff, 5 | 6))
}

/// Whether the database said the statement's table does not exist.
pub(crate) fn is_missing_table(err: &sea_orm::DbErr) -> bool {
    use sea_orm::{DbErr, RuntimeErr, sqlx};
    let (DbErr::Exec(RuntimeErr::SqlxError(err)) | DbErr::Query(RuntimeErr::SqlxError(err))) = err
    else {
        return false;
    };
    let sqlx::Error::Database(db) = &**err else {
        return false;
    };
    if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // ER_NO_SUCH_TABLE
        return mysql.number() == 1146;
    }
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // SQLite reports it as a plain SQLITE_ERROR; only the message tells.
        return db.message().starts_with("no such table");
    }
    // PostgreSQL's undefined_table.
    db.code().as_deref() == Some("42P01")
}
