//! Driver errors as shardkit shows them: scrubbed of secrets, each cause
//! once, values quoted within a bound.

use sea_orm::DbErr;

/// A driver's error with its secrets removed: what the database or the
/// connection said (a URL's password scrubbed from it) and the driver's
/// code where it gave one. The [`source`](std::error::Error::source) of
/// [`ShardError::Connect`](crate::ShardError::Connect); the driver's own error is not kept, since its
/// text may carry the password.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    message: String,
    code: Option<String>,
}

impl DriverError {
    /// A driver error of `message` (already scrubbed of secrets).
    pub(crate) fn new(message: impl Into<String>) -> Self {
        DriverError {
            message: message.into(),
            code: None,
        }
    }

    /// The error of `source`, its text passed through `scrub`.
    pub(crate) fn of(source: &DbErr, scrub: impl Fn(&str) -> String) -> Self {
        DriverError {
            message: scrub(&DriverCause(source).to_string()),
            code: database_code(source),
        }
    }

    /// What the driver said (secrets scrubbed).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The driver's code (PostgreSQL's SQLSTATE, MySQL/MariaDB's error
    /// number, SQLite's result code), when the database answered with one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

/// The code the database answered `source` with (PostgreSQL's SQLSTATE,
/// MySQL/MariaDB's error number, SQLite's result code), if it did.
pub(crate) fn database_code(source: &DbErr) -> Option<String> {
    match source {
        DbErr::Conn(sea_orm::RuntimeErr::SqlxError(e))
        | DbErr::Exec(sea_orm::RuntimeErr::SqlxError(e))
        | DbErr::Query(sea_orm::RuntimeErr::SqlxError(e)) => e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned()),
        _ => None,
    }
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DriverError {}

/// The driver's own error inside a [`DbErr`], once: what the database or
/// the connection said, with its code, without SeaORM's and SQLx's
/// wrappers (`Execution Error: error returned from database: ...`), which
/// repeat it at every level of the source chain.
///
/// PostgreSQL's message is followed by its SQLSTATE (SQLx's own text adds
/// the line of the server's C source instead); MySQL/MariaDB's and
/// SQLite's keep SQLx's form, which leads with the code. Details that may
/// quote row values (PostgreSQL's `DETAIL`) are left out.
///
/// For printing a [`DbErr`] of a statement sent through
/// [`Cluster::connection`](crate::Cluster::connection) the way shardkit's
/// own errors print theirs (the operator's `status` prints a failed
/// server-version query so):
///
/// ```
/// # use shardkit::error::DriverCause;
/// let err = sea_orm::DbErr::Custom("no such table: notes".into());
/// assert_eq!(DriverCause(&err).to_string(), "Custom Error: no such table: notes");
/// ```
pub struct DriverCause<'a>(pub &'a DbErr);

impl std::fmt::Display for DriverCause<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use sea_orm::RuntimeErr;
        let runtime = match self.0 {
            DbErr::Conn(r) | DbErr::Exec(r) | DbErr::Query(r) => r,
            other => return write!(f, "{other}"),
        };
        match runtime {
            RuntimeErr::SqlxError(e) => write!(f, "{}", SqlxCause(e)),
            RuntimeErr::Internal(message) => f.write_str(message),
        }
    }
}

/// [`DriverCause`] of SQLx's error (a probe's or a pool's connection
/// attempt): a database's error by its message and code, any other by
/// SQLx's message (`error communicating with database: Connection refused
/// (os error 111)`).
pub(crate) struct SqlxCause<'a>(pub(crate) &'a sea_orm::sqlx::Error);

impl std::fmt::Display for SqlxCause<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use sea_orm::sqlx;
        let sqlx::Error::Database(db) = self.0 else {
            return write!(f, "{}", self.0);
        };
        if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            return write!(f, "{} (SQLSTATE {})", pg.message(), pg.code());
        }
        if db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some()
            || db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
        {
            return write!(f, "{db}");
        }
        match db.code() {
            Some(code) => write!(f, "{} (code {code})", db.message()),
            None => f.write_str(db.message()),
        }
    }
}

/// How many characters of a user's value an error message quotes.
pub(crate) const QUOTED_CHARS: usize = 64;

/// A value quoted in a message: its first [`QUOTED_CHARS`] characters, and
/// how long it is when that is not all of it.
pub(crate) struct Bounded<'a>(pub(crate) &'a str);

impl std::fmt::Display for Bounded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chars = self.0.chars().count();
        if chars <= QUOTED_CHARS {
            return write!(f, "{:?}", self.0);
        }
        let prefix: String = self.0.chars().take(QUOTED_CHARS).collect();
        write!(f, "{prefix:?}... ({chars} characters)")
    }
}

impl std::fmt::Debug for Bounded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}
