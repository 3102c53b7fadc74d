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

    /// Opens one connection and closes it; the cause (password scrubbed)
    /// when that fails or takes longer than the timeout.
    pub(crate) async fn probe_once(&self) -> std::result::Result<(), String> {
        use sea_orm::sqlx::{ConnectOptions as _, Connection as _};
        let timeout = self.timeout;
        let result = match &self.probe {
            Probe::None => return Ok(()),
            Probe::Postgres(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(no_answer(timeout)),
            },
            Probe::MySql(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(no_answer(timeout)),
            },
        };
        result.map_err(|cause| self.url.scrub(&cause))
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

fn no_answer(timeout: Duration) -> String {
    format!(
        "the server accepted no connection within {} ms (connect timeout): it is down or hung",
        timeout.as_millis()
    )
}
