//! Every request to a shard runs under the shard's circuit breaker
//! ([`crate::exec::health`]).

use crate::error::{Result, ShardError};
use crate::exec::health::{Gate, HEALTHY_FOR, REPROBE, SUSPECT_AFTER, suspects_down};
use crate::exec::shards::Shards;
use crate::topology::ShardId;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The breaker around every request (see [`crate::exec::health`]).
impl Shards {
    /// Runs `fut`, a request that needs a connection of shard `id`, under
    /// the shard's breaker and `timeout`. While the shard is down the
    /// request waits on the probe that it starts or finds started (half-open,
    /// at most [`HALF_OPEN_WAIT`](crate::exec::health::HALF_OPEN_WAIT) from
    /// the probe's start) and runs if the probe finds the shard up; it fails
    /// with [`ShardError::Unavailable`] if the probe finds it down, and at
    /// once when no probe is due. While the shard is up it fails with
    /// `Unavailable` as soon as a probe started while `fut` waits finds it
    /// down; otherwise `fut` decides (or the timeout, [`ShardError::Timeout`]).
    pub(crate) async fn bounded<T>(
        &self,
        id: ShardId,
        group: &'static str,
        timeout: Option<Duration>,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let health = self.health(id);
        let shard = self.shard_name(id);
        let unavailable = |cause: String| {
            self.reprobe(id, &cause);
            ShardError::Unavailable {
                shard: shard.to_owned(),
                cause,
            }
        };
        let watched = async {
            match health.gate(self.clock()) {
                Gate::Closed => {}
                Gate::Open(cause) => return Err(unavailable(cause)),
                Gate::HalfOpen { until, probe } => {
                    match tokio::time::timeout_at(until, probe).await {
                        // Seen up just now: the request goes on.
                        Ok(Ok(())) => {}
                        Ok(Err(cause)) => return Err(unavailable(cause)),
                        // The probe runs on (it may hang for the connect
                        // timeout); this request does not wait for it.
                        // (Unless it found the shard up at that moment.)
                        Err(_) => {
                            if let Some(cause) = health.down_cause() {
                                return Err(unavailable(cause));
                            }
                        }
                    }
                }
            }
            tokio::select! {
                biased;
                result = fut => match result {
                    // The pool gave up connecting (its own timeout may be
                    // shorter than the probe's): ask the probe why. (Not
                    // for a server at its connection limit: it is up.)
                    Err(ref err) if suspects_down(err) && health.can_probe() => {
                        match self.probe_shared(id).await {
                            Err(cause) => Err(unavailable(cause)),
                            Ok(()) => result,
                        }
                    }
                    other => other,
                },
                cause = self.watch(id) => Err(unavailable(cause)),
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

    /// Shard `id`'s state from a recent, running or new probe (a failure
    /// marks it down).
    async fn probe_shared(&self, id: ShardId) -> std::result::Result<(), String> {
        let health = Arc::clone(self.health(id));
        health.check_on(self.clock()).await
    }

    /// Shard `id` was found down: unless one runs, starts the background
    /// probe that brings it back when no request needs it.
    fn reprobe(&self, id: ShardId, cause: &str) {
        let health = self.health(id);
        if health.down_cause().is_none() || !health.start_reprobing() {
            return;
        }
        tracing::warn!(
            shard = self.shard_name(id),
            cause,
            "shard down: requests fail fast, except while a probe runs, until a probe reaches it"
        );
        crate::exec::periodic::spawn(
            self,
            REPROBE,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |shards: Shards| async move {
                let health = Arc::clone(shards.health(id));
                if let Some(probe) = health.probe_if_due(shards.clock()) {
                    let _ = probe.await;
                }
                if health.down_cause().is_some() {
                    return std::ops::ControlFlow::Continue(());
                }
                health.stop_reprobing();
                // Down again since: go on unless another task took over.
                if health.down_cause().is_some() && health.start_reprobing() {
                    return std::ops::ControlFlow::Continue(());
                }
                tracing::info!(shard = shards.shard_name(id), "shard back up");
                std::ops::ControlFlow::Break(())
            },
        );
    }
}
