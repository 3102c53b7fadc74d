//! Per-shard circuit breakers.
//!
//! A pool asked for a connection to a server that refuses or never answers
//! retries until its acquire timeout (30 s by default) and then reports only
//! "pool timed out". shardkit instead watches every request that waits on a
//! shard: one still waiting after [`SUSPECT_AFTER`] starts a probe (one
//! connection opened directly, bounded by the connect timeout, shared by
//! every waiter of the shard). A failed probe marks the shard down with the
//! driver's own cause ("connection refused", "no answer within 1 s"): the
//! waiting requests fail with [`ShardError::Unavailable`](crate::ShardError::Unavailable), and so does every
//! later request of that shard, at once and without I/O, until a background
//! probe (every [`REPROBE`], stopped when the cluster is dropped) reaches
//! the server again.
//!
//! A server at its connection limit (PostgreSQL's "too many clients",
//! MySQL/MariaDB's "Too many connections") answered: neither a request
//! failing with that nor a probe refused with it marks the shard down
//! ([`suspects_down`], [`ProbeFailure::Full`]); the request fails with the
//! database's error, which is [`Retry::After`](crate::Retry::After) a short
//! wait.

use crate::error::{ShardError, SqlxCause, is_capacity, sqlx_is_capacity};
use crate::topology::DatabaseUrl;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a request waits on a shard before its health is checked.
pub(crate) const SUSPECT_AFTER: Duration = Duration::from_millis(150);

pub(crate) use crate::error::REPROBE;

/// How long a successful probe vouches for a shard.
pub(crate) const HEALTHY_FOR: Duration = Duration::from_secs(1);

/// How one shard is probed.
enum Probe {
    Postgres(sea_orm::sqlx::postgres::PgConnectOptions),
    MySql(sea_orm::sqlx::mysql::MySqlConnectOptions),
    /// SQLite files are opened in-process: nothing to probe.
    None,
}

/// One shard's breaker.
pub(crate) struct ShardHealth {
    probe: Probe,
    timeout: Duration,
    url: DatabaseUrl,
    /// Why the shard is down, if it is.
    down: Mutex<Option<String>>,
    /// The last probe's time and outcome.
    last: Mutex<Option<(Instant, std::result::Result<(), String>)>>,
    /// One probe at a time.
    probing: tokio::sync::Mutex<()>,
}

impl ShardHealth {
    /// Whether the shard can be probed at all (a probe connection exists
    /// for its backend).
    pub(crate) fn can_probe(&self) -> bool {
        !matches!(self.probe, Probe::None)
    }

    /// The breaker of a shard at `url`; probes wait at most `timeout`.
    pub(crate) fn new(url: &DatabaseUrl, timeout: Duration) -> Self {
        use std::str::FromStr;
        let (driver_url, password) = url.for_driver();
        let probe = if driver_url.starts_with("postgres") {
            match sea_orm::sqlx::postgres::PgConnectOptions::from_str(&driver_url) {
                Ok(opts) => Probe::Postgres(match &password {
                    Some(p) => opts.password(p),
                    None => opts,
                }),
                Err(_) => Probe::None,
            }
        } else if driver_url.starts_with("mysql") || driver_url.starts_with("mariadb") {
            match sea_orm::sqlx::mysql::MySqlConnectOptions::from_str(&driver_url) {
                Ok(opts) => Probe::MySql(match &password {
                    Some(p) => opts.password(p),
                    None => opts,
                }),
                Err(_) => Probe::None,
            }
        } else {
            Probe::None
        };
        ShardHealth {
            probe,
            timeout,
            url: url.clone(),
            down: Mutex::new(None),
            last: Mutex::new(None),
            probing: tokio::sync::Mutex::new(()),
        }
    }

    /// Why the shard is down, if it is.
    pub(crate) fn down_cause(&self) -> Option<String> {
        self.down.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The breaker's probe: opens one connection and closes it; the cause
    /// (password scrubbed) when that fails or takes longer than the
    /// timeout. A server that refuses the connection for having too many
    /// ([`ProbeFailure::Full`]) answered: it is up.
    pub(crate) async fn probe_once(&self) -> std::result::Result<(), String> {
        match self.connect_once().await {
            Ok(()) | Err(ProbeFailure::Full(_)) => Ok(()),
            Err(ProbeFailure::Down(cause)) => Err(cause),
        }
    }

    /// Opens one connection and closes it, saying why when that fails or
    /// takes longer than the timeout (the cause's password scrubbed).
    pub(crate) async fn connect_once(&self) -> std::result::Result<(), ProbeFailure> {
        use sea_orm::sqlx::{ConnectOptions as _, Connection as _};
        let timeout = self.timeout;
        let result = match &self.probe {
            Probe::None => return Ok(()),
            Probe::Postgres(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => return Err(ProbeFailure::Down(no_answer(timeout))),
            },
            Probe::MySql(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => return Err(ProbeFailure::Down(no_answer(timeout))),
            },
        };
        result.map_err(|e| {
            let cause = self.url.scrub(&SqlxCause(&e).to_string());
            if sqlx_is_capacity(&e) {
                ProbeFailure::Full(cause)
            } else {
                ProbeFailure::Down(cause)
            }
        })
    }

    /// The shard's state as of a probe at most [`HEALTHY_FOR`] old (running
    /// one when there is none); a failure marks it down.
    pub(crate) async fn check(self: &Arc<Self>) -> std::result::Result<(), String> {
        let _one = self.probing.lock().await;
        if let Some((at, result)) = &*self.last.lock().unwrap_or_else(|p| p.into_inner())
            && at.elapsed() < HEALTHY_FOR
        {
            return result.clone();
        }
        let result = self.probe_once().await;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), result.clone()));
        result
    }

    /// Marks the shard down; `true` if it was up.
    pub(crate) fn mark_down(&self, cause: &str) -> bool {
        let mut down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        let was_up = down.is_none();
        *down = Some(cause.to_owned());
        was_up
    }

    pub(crate) fn mark_up(&self) {
        *self.down.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Why a probe's connection failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ProbeFailure {
    /// The server is down, hung or refuses this client: the shard is down.
    Down(String),
    /// The server answered that it has too many connections
    /// ([`crate::error::is_capacity`]): it is up, and accepts connections
    /// again as others close. The breaker does not open for it.
    Full(String),
}

impl ProbeFailure {
    /// The cause, password scrubbed.
    pub(crate) fn into_cause(self) -> String {
        match self {
            ProbeFailure::Down(cause) | ProbeFailure::Full(cause) => cause,
        }
    }
}

/// Whether a request's error makes the breaker suspect its shard is down
/// (and so probe it): the pool could not hand out a connection, or the
/// connection failed, except when the server refused it for having too
/// many connections. Statement errors, timeouts and capacity errors never
/// mark a shard down.
pub(crate) fn suspects_down(err: &ShardError) -> bool {
    match err {
        ShardError::Db { source, .. } => {
            matches!(
                source,
                sea_orm::DbErr::ConnectionAcquire(_) | sea_orm::DbErr::Conn(_)
            ) && !is_capacity(source)
        }
        _ => false,
    }
}

fn no_answer(timeout: Duration) -> String {
    format!(
        "the server accepted no connection within {} ms (connect timeout): it is down or hung",
        timeout.as_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on a free local port that answers every connection with
    /// `reply` (after reading the client's first message) and closes it.
    async fn refusing_server(pg: bool, reply: Vec<u8>) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let reply = reply.clone();
                tokio::spawn(async move {
                    if pg {
                        // SSLRequest (answered `N`), then the startup message.
                        loop {
                            let len = socket.read_u32().await.unwrap_or(0) as usize;
                            let mut body = vec![0; len.saturating_sub(4)];
                            if socket.read_exact(&mut body).await.is_err() {
                                return;
                            }
                            if body.get(..4) == Some(&80_877_103u32.to_be_bytes()[..]) {
                                let _ = socket.write_all(b"N").await;
                                continue;
                            }
                            break;
                        }
                    }
                    let _ = socket.write_all(&reply).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        port
    }

    /// PostgreSQL's refusal of a connection: an `ErrorResponse` with
    /// SQLSTATE 53300, as a server at `max_connections` sends it.
    fn pg_too_many_clients() -> Vec<u8> {
        let mut fields = Vec::new();
        for (tag, value) in [
            (b'S', "FATAL"),
            (b'V', "FATAL"),
            (b'C', "53300"),
            (b'M', "sorry, too many clients already"),
            (b'F', "proc.c"),
            (b'L', "359"),
            (b'R', "InitProcess"),
        ] {
            fields.push(tag);
            fields.extend_from_slice(value.as_bytes());
            fields.push(0);
        }
        fields.push(0);
        let mut message = vec![b'E'];
        message.extend_from_slice(&(fields.len() as u32 + 4).to_be_bytes());
        message.extend_from_slice(&fields);
        message
    }

    /// MySQL/MariaDB's refusal in place of its greeting: an ERR packet 1040.
    fn mysql_too_many_connections() -> Vec<u8> {
        let mut payload = vec![0xff];
        payload.extend_from_slice(&1040u16.to_le_bytes());
        payload.extend_from_slice(b"Too many connections");
        let mut packet = (payload.len() as u32).to_le_bytes()[..3].to_vec();
        packet.push(0);
        packet.extend_from_slice(&payload);
        packet
    }

    /// A probe refused for having too many connections finds the server up
    /// (the breaker stays closed); `connect_once` still says why, for
    /// `Cluster::connect`, with the password scrubbed.
    #[tokio::test]
    async fn a_server_at_its_connection_limit_is_not_down() {
        let pg = refusing_server(true, pg_too_many_clients()).await;
        let mysql = refusing_server(false, mysql_too_many_connections()).await;
        for (url, cause) in [
            (
                format!("postgres://app:hunter2@127.0.0.1:{pg}/shop"),
                "sorry, too many clients already (SQLSTATE 53300)",
            ),
            (
                format!("mysql://app:hunter2@127.0.0.1:{mysql}/shop"),
                "1040: Too many connections",
            ),
        ] {
            let health = ShardHealth::new(&DatabaseUrl::new(url.clone()), Duration::from_secs(5));
            assert_eq!(
                health.connect_once().await,
                Err(ProbeFailure::Full(cause.to_owned())),
                "{url}"
            );
            assert_eq!(health.probe_once().await, Ok(()), "{url}");
            let health = Arc::new(health);
            assert_eq!(health.check().await, Ok(()), "{url}");
            assert_eq!(health.down_cause(), None);
        }
    }

    /// A refused connection is a shard down.
    #[tokio::test]
    async fn a_refused_connection_is_down() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let url = DatabaseUrl::new(format!("postgres://app:hunter2@127.0.0.1:{port}/shop"));
        let health = ShardHealth::new(&url, Duration::from_secs(5));
        let Err(ProbeFailure::Down(cause)) = health.connect_once().await else {
            panic!("expected the shard down");
        };
        assert!(
            cause.starts_with("error communicating with database: "),
            "{cause}"
        );
        assert!(!cause.contains("hunter2"), "{cause}");
    }

    /// The breaker's decision: which request errors make it probe (and so
    /// possibly mark the shard down).
    #[test]
    fn the_breaker_suspects_connection_failures_but_not_a_full_server() {
        use crate::error::tests::{conn_err, too_many_clients};
        use sea_orm::sqlx;
        let db = |source| ShardError::Db {
            origin: Box::new(crate::error::Origin::Group("Customer")),
            shard: "s1".to_owned(),
            operation: "begin".to_owned(),
            source,
        };
        assert!(!suspects_down(&db(too_many_clients())));
        assert!(suspects_down(&db(conn_err(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused)
        )))));
        assert!(suspects_down(&db(sea_orm::DbErr::ConnectionAcquire(
            sea_orm::error::ConnAcquireErr::Timeout
        ))));
        assert!(!suspects_down(&db(sea_orm::DbErr::Exec(
            sea_orm::RuntimeErr::Internal("syntax error".to_owned())
        ))));
        assert!(!suspects_down(&ShardError::Timeout {
            group: "Customer",
            shard: "s1".to_owned(),
            after: Duration::from_secs(1),
        }));
    }
}
