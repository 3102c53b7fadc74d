//! Unit tests of the error classification and reports.

use crate::error::ErrorKind;
use crate::error::Origin;
use crate::error::Retry;
use crate::error::ShardError;
use crate::error::Synthetic;
use crate::error::classify::mysql_is_capacity;
use crate::error::is_capacity;
use sea_orm::DbErr;
use sea_orm::sqlx::error::{DatabaseError, ErrorKind as SqlxKind};
use sea_orm::{RuntimeErr, sqlx};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

/// A database's error with a code, as a driver other than SQLite's and
/// MySQL's reports it (PostgreSQL's cannot be built outside SQLx).
#[derive(Debug)]
pub(crate) struct Coded(pub(crate) &'static str, pub(crate) &'static str);

impl std::fmt::Display for Coded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.1)
    }
}

impl std::error::Error for Coded {}

impl DatabaseError for Coded {
    fn message(&self) -> &str {
        self.1
    }
    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self.0))
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
    fn kind(&self) -> SqlxKind {
        SqlxKind::Other
    }
}

pub(crate) fn conn_err(e: sqlx::Error) -> DbErr {
    DbErr::Conn(RuntimeErr::SqlxError(Arc::new(e)))
}

pub(crate) fn too_many_clients() -> DbErr {
    conn_err(sqlx::Error::Database(Box::new(Coded(
        "53300",
        "sorry, too many clients already",
    ))))
}

fn db(source: DbErr) -> ShardError {
    ShardError::db(Origin::Group("Customer"), "s1", "begin", source)
}

#[test]
fn a_sqlite_write_slot_waited_out_is_database_is_locked_retried_after_a_short_wait() {
    let err = db(Synthetic::sqlite_slot(Duration::from_secs(5)));
    assert!(err.is_sqlite_busy());
    assert_eq!(err.retry(), Retry::After(Duration::from_millis(50)));
    assert_eq!(err.kind(), ErrorKind::Database);
    assert_eq!(
        err.to_string(),
        "begin on `s1` (group `Customer`) failed: database is locked: waited 5s (the busy \
         timeout) for the write slot the cluster's SQLite files share; another write \
         transaction, of this process or another, held it (code 5)"
    );
    assert!(!db(too_many_clients()).is_sqlite_busy());
}

#[test]
fn a_server_at_its_connection_limit_is_retried_after_a_short_wait() {
    let err = db(too_many_clients());
    assert!(is_capacity(&too_many_clients()));
    assert_eq!(err.retry(), Retry::After(Duration::from_millis(100)));
    assert_eq!(err.kind(), ErrorKind::Database);
    // The same code from a statement (a role's or database's limit
    // reached by a `dblink`, say) is one too.
    let exec = DbErr::Exec(RuntimeErr::SqlxError(Arc::new(sqlx::Error::Database(
        Box::new(Coded("53300", "too many connections for role \"app\"")),
    ))));
    assert!(is_capacity(&exec));
    // Other errors are not.
    let refused = conn_err(sqlx::Error::Io(std::io::Error::from(
        std::io::ErrorKind::ConnectionRefused,
    )));
    assert!(!is_capacity(&refused));
    assert_eq!(db(refused).retry(), Retry::Now);
    let deadlock = conn_err(sqlx::Error::Database(Box::new(Coded(
        "40P01",
        "deadlock detected",
    ))));
    assert!(!is_capacity(&deadlock));
    assert_eq!(db(deadlock).retry(), Retry::Transaction);
    assert!(!is_capacity(&DbErr::ConnectionAcquire(
        sea_orm::error::ConnAcquireErr::Timeout
    )));
}

#[test]
fn mysql_capacity_errors_are_1040_and_1203() {
    assert!(mysql_is_capacity(1040));
    assert!(mysql_is_capacity(1203));
    assert!(!mysql_is_capacity(1213));
    assert!(!mysql_is_capacity(1205));
    assert!(!mysql_is_capacity(1045));
}

#[test]
fn a_db_error_says_what_where_and_the_driver_message_once() {
    let err = db(too_many_clients());
    assert_eq!(
        err.to_string(),
        "begin on `s1` (group `Customer`) failed: sorry, too many clients already (code 53300)"
    );
    assert_eq!(err.report().to_string(), err.to_string());
    // SeaORM's error is still the source, for code that inspects it.
    let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<DbErr>());
    assert!(matches!(source, Some(DbErr::Conn(_))), "{err:?}");

    let lost = db(conn_err(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        "connection reset by peer",
    ))));
    assert_eq!(
        lost.report().to_string(),
        "begin on `s1` (group `Customer`) failed: error communicating with database: \
         connection reset by peer"
    );
    let pool = db(DbErr::ConnectionAcquire(
        sea_orm::error::ConnAcquireErr::Timeout,
    ));
    assert_eq!(
        pool.report().to_string(),
        "begin on `s1` (group `Customer`) failed: Failed to acquire connection from pool: \
         Connection pool timed out"
    );
    let migration = ShardError::Migration {
        shard: "s2".to_owned(),
        source: DbErr::Migration("table `orders` exists".to_owned()),
    };
    assert_eq!(
        migration.report().to_string(),
        "migrating shard `s2` failed: Migration Error: table `orders` exists"
    );
}

#[test]
fn an_expired_bucket_map_says_how_old_and_why_once_and_is_retried_later() {
    let timeout = ShardError::Timeout {
        group: "Customer",
        shard: "s0".to_owned(),
        after: Duration::from_millis(500),
    };
    let cause = timeout.report().to_string();
    let expired = |age| ShardError::BucketMapExpired {
        group: "Customer",
        age,
        grace: Duration::from_secs(600),
        cause: cause.clone(),
    };
    let old = expired(Some(Duration::from_millis(451_900)))
        .report()
        .to_string();
    assert_eq!(
        old,
        format!(
            "bucket map of group `Customer` last read 451s ago (a read needs it read within three \
             quarters of the cleanup grace, 600s): a moved bucket's old rows may be gone, so the \
             read is refused; reading the map again failed: {cause}"
        )
    );
    assert_eq!(old.matches("did not answer").count(), 1, "{old}");
    let never = expired(None).report().to_string();
    assert!(
        never.starts_with(
            "bucket map of group `Customer` never read since this instance connected ("
        ),
        "{never}"
    );
    assert_eq!(expired(None).kind(), ErrorKind::Database);
    assert_eq!(expired(None).retry(), Retry::After(Duration::from_secs(1)));
}
