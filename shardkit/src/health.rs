//! Per-shard circuit breakers.
//!
//! A pool asked for a connection to a server that refuses or never answers
//! retries until its acquire timeout (30 s by default) and then reports only
//! "pool timed out". shardkit instead watches every request that waits on a
//! shard: one still waiting after [`SUSPECT_AFTER`] starts a probe (one
//! connection opened directly, bounded by the connect timeout, shared by
//! every waiter of the shard). A failed probe marks the shard down with the
//! driver's own cause ("connection refused", "no answer within 1 s"): the
//! waiting requests fail with [`ShardError::Unavailable`], and so does every
//! later request of that shard, at once and without I/O, until a background
//! probe (every [`REPROBE`], stopped when the cluster is dropped) reaches
//! the server again.

use crate::cluster::Cluster;
use crate::error::{Result, ShardError};
use crate::topology::{DatabaseUrl, ShardId};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a request waits on a shard before its health is checked.
pub(crate) const SUSPECT_AFTER: Duration = Duration::from_millis(150);

/// How often a down shard is probed.
pub(crate) const REPROBE: Duration = Duration::from_millis(500);

/// How long a successful probe vouches for a shard.
const HEALTHY_FOR: Duration = Duration::from_secs(1);

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
    async fn check(self: &Arc<Self>) -> std::result::Result<(), String> {
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
    fn mark_down(&self, cause: &str) -> bool {
        let mut down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        let was_up = down.is_none();
        *down = Some(cause.to_owned());
        was_up
    }

    fn mark_up(&self) {
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

impl Cluster {
    /// Runs `fut`, a request that needs a connection of shard `id`, under
    /// the shard's breaker and `timeout`: fails at once with
    /// [`ShardError::Unavailable`] while the shard is down, and as soon as a
    /// probe started while `fut` waits finds it down; otherwise `fut`
    /// decides (or the timeout, [`ShardError::Timeout`]).
    pub(crate) async fn bounded<T>(
        &self,
        id: ShardId,
        group: &'static str,
        timeout: Option<Duration>,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let health = self.health(id);
        let shard = self.shard_name(id);
        if let Some(cause) = health.down_cause() {
            return Err(ShardError::Unavailable {
                shard: shard.to_owned(),
                cause,
            });
        }
        let watched = async {
            tokio::select! {
                biased;
                result = fut => match result {
                    // The pool gave up connecting (its own timeout may be
                    // shorter than the probe's): ask the probe why.
                    Err(ShardError::Db {
                        source: sea_orm::DbErr::ConnectionAcquire(_) | sea_orm::DbErr::Conn(_),
                        ..
                    }) if !matches!(health.probe, Probe::None) => {
                        match self.probe_shared(id).await {
                            Err(cause) => Err(ShardError::Unavailable {
                                shard: shard.to_owned(),
                                cause,
                            }),
                            Ok(()) => result,
                        }
                    }
                    other => other,
                },
                cause = self.watch(id) => Err(ShardError::Unavailable {
                    shard: shard.to_owned(),
                    cause,
                }),
            }
        };
        match timeout {
            None => watched.await,
            Some(after) => tokio::time::timeout(after, watched)
                .await
                .unwrap_or_else(|_| {
                    Err(ShardError::Timeout {
                        group,
                        shard: shard.to_owned(),
                        after,
                    })
                }),
        }
    }

    /// Completes (with the cause) only once shard `id` is found down.
    async fn watch(&self, id: ShardId) -> String {
        tokio::time::sleep(SUSPECT_AFTER).await;
        loop {
            match self.probe_shared(id).await {
                Err(cause) => return cause,
                Ok(()) => tokio::time::sleep(HEALTHY_FOR).await,
            }
        }
    }

    /// Shard `id`'s state from a recent or new probe, marking it down when
    /// the probe fails.
    async fn probe_shared(&self, id: ShardId) -> std::result::Result<(), String> {
        let health = Arc::clone(self.health(id));
        // In a task of its own: a request that gives up (its timeout) must
        // not cancel the probe that would mark the shard down.
        let probe = tokio::spawn(async move { health.check().await });
        match probe.await {
            Ok(Err(cause)) => {
                self.shard_down(id, &cause);
                Err(cause)
            }
            Ok(Ok(())) | Err(_) => Ok(()),
        }
    }

    /// Marks shard `id` down and, if it was up, starts the probe that
    /// brings it back.
    pub(crate) fn shard_down(&self, id: ShardId, cause: &str) {
        let health = self.health(id);
        if !health.mark_down(cause) {
            return;
        }
        tracing::warn!(
            shard = self.shard_name(id),
            cause,
            "shard down: requests fail fast until a probe reaches it"
        );
        crate::periodic::spawn(
            self,
            REPROBE,
            crate::periodic::FirstPass::AfterInterval,
            move |cluster| async move {
                let health = Arc::clone(cluster.health(id));
                match health.probe_once().await {
                    Ok(()) => {
                        health.mark_up();
                        tracing::info!(shard = cluster.shard_name(id), "shard back up");
                        std::ops::ControlFlow::Break(())
                    }
                    Err(cause) => {
                        health.mark_down(&cause);
                        std::ops::ControlFlow::Continue(())
                    }
                }
            },
        );
    }
}
