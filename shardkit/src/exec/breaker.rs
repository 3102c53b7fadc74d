//! Every request to a shard runs under the shard's circuit breaker
//! ([`crate::exec::health`]).

use super::shards::Shards;
use crate::error::{Result, ShardError};
use crate::exec::health::{HEALTHY_FOR, REPROBE, SUSPECT_AFTER, suspects_down};
use crate::topology::ShardId;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The breaker around every request (see [`crate::exec::health`]).
impl Shards {
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
            let err = ShardError::Unavailable {
                shard: shard.to_owned(),
                cause,
            };
            crate::metrics::request_failed(shard, &err);
            return Err(err);
        }
        let watched = async {
            tokio::select! {
                biased;
                result = fut => match result {
                    // The pool gave up connecting (its own timeout may be
                    // shorter than the probe's): ask the probe why. (Not
                    // for a server at its connection limit: it is up.)
                    Err(ref err) if suspects_down(err) && health.can_probe() => {
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
        let result = match timeout {
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
        };
        if let Err(err) = &result {
            crate::metrics::request_failed(shard, err);
        }
        result
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
        crate::exec::periodic::spawn(
            self,
            REPROBE,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |shards: Shards| async move {
                let health = Arc::clone(shards.health(id));
                match health.probe_once().await {
                    Ok(()) => {
                        health.mark_up();
                        tracing::info!(shard = shards.shard_name(id), "shard back up");
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
