//! Every request to a shard runs under the shard's circuit breaker
//! ([`crate::exec::health`]).

use crate::error::{Result, ShardError};
use crate::exec::health::{Gate, HEALTHY_FOR, REPROBE, SUSPECT_AFTER, suspects_down};
use crate::exec::shards::Shards;
use crate::exec::watchdog::{self, Due, Ticker};
use crate::topology::ShardId;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// The breaker around every request (see [`crate::exec::health`]).
impl Shards {
    /// Runs `fut`, a request that needs a connection of shard `id`, under
    /// the shard's breaker and `timeout`. While the shard is down the
    /// request waits on the probe that it starts or finds started (half-open,
    /// at most [`HALF_OPEN_WAIT`](crate::exec::health::HALF_OPEN_WAIT) from
    /// the probe's start) and runs if the probe finds the shard up; it fails
    /// with [`ShardError::Unavailable`] if the probe finds it down, and at
    /// once when no probe is due. While the shard is up, a PostgreSQL or
    /// MySQL request that has waited [`SUSPECT_AFTER`] fails with
    /// `Unavailable` once the shard's watch finds the shard down (by a probe,
    /// or one that ended less than a second ago; see [`Self::watched`]);
    /// otherwise `fut` decides (or the timeout, [`ShardError::Timeout`]).
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
            let result = if health.can_probe() {
                match self.watched(id, fut).await {
                    Ok(result) => result,
                    Err(cause) => return Err(unavailable(cause)),
                }
            } else {
                // SQLite: opened in-process, nothing to probe or watch.
                fut.await
            };
            match result {
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

    /// Runs `fut` on shard `id` while the shard's watch looks on: its
    /// output, or the cause once the shard is found down while `fut` waited
    /// longer than [`SUSPECT_AFTER`].
    async fn watched<T>(
        &self,
        id: ShardId,
        fut: impl Future<Output = T>,
    ) -> std::result::Result<T, String> {
        let mut waiting = self.health(id).waiting().registration();
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            match waiting.poll(cx.waker()) {
                watchdog::Poll::Down(cause) => Poll::Ready(Err(cause)),
                watchdog::Poll::Waiting(ticker) => {
                    if let Some(ticker) = ticker {
                        self.start_watch(id, ticker);
                    }
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Starts shard `id`'s watch task: it sleeps until the oldest waiting
    /// request is due, then probes the shard (a recent probe's outcome
    /// stands for [`HEALTHY_FOR`]); found down, the requests that were
    /// overdue fail with the cause. It ends when no request waits that it
    /// has not failed.
    fn start_watch(&self, id: ShardId, ticker: Ticker) {
        // Gives the watch up when the task ends, however it ends (the
        // closure owns the claim: it ends with the task, run or not).
        let claim = {
            let health = Arc::clone(self.health(id));
            crate::exec::periodic::Claim::new(move || health.waiting().release(ticker))
        };
        crate::exec::periodic::spawn_paced(self, move |shards: Shards| {
            let _claim = &claim;
            async move {
                let waiting = shards.health(id).waiting();
                match waiting.due(SUSPECT_AFTER) {
                    Due::Idle if waiting.stop_if_idle(ticker) => ControlFlow::Break(()),
                    // Registered just now: look again at once.
                    Due::Idle => ControlFlow::Continue(Duration::ZERO),
                    Due::At(at) => ControlFlow::Continue(
                        at.saturating_duration_since(tokio::time::Instant::now()),
                    ),
                    Due::Now(cutoff) => {
                        if let Err(cause) = shards.probe_shared(id).await {
                            waiting.fail_since(cutoff, &cause);
                            return ControlFlow::Continue(Duration::ZERO);
                        }
                        // Up: the overdue requests wait on, looked at
                        // again once that outcome is old ([`HEALTHY_FOR`]),
                        // or sooner when a newer request is due.
                        let now = tokio::time::Instant::now();
                        let next = waiting.due_after(cutoff, SUSPECT_AFTER);
                        let wait = next.map_or(HEALTHY_FOR, |at| {
                            at.saturating_duration_since(now).min(HEALTHY_FOR)
                        });
                        ControlFlow::Continue(wait)
                    }
                }
            }
        });
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
        // Given up when the task ends without having given it up itself
        // (its runtime shut down, before the task ran or while it ran): the
        // next outage starts another.
        let claim = {
            let health = Arc::clone(health);
            Arc::new(crate::exec::periodic::Claim::new(move || {
                health.stop_reprobing();
            }))
        };
        crate::exec::periodic::spawn(
            self,
            REPROBE,
            crate::exec::periodic::FirstPass::AfterInterval,
            move |shards: Shards| {
                let claim = Arc::clone(&claim);
                async move {
                    let health = shards.health(id);
                    if let Some(probe) = health.probe_if_due(shards.clock()) {
                        let _ = probe.await;
                    }
                    if health.down_cause().is_some() {
                        return std::ops::ControlFlow::Continue(());
                    }
                    claim.arm(false);
                    health.stop_reprobing();
                    // Down again since: go on unless another task took over.
                    if health.down_cause().is_some() && health.start_reprobing() {
                        claim.arm(true);
                        return std::ops::ControlFlow::Continue(());
                    }
                    tracing::info!(shard = shards.shard_name(id), "shard back up");
                    std::ops::ControlFlow::Break(())
                }
            },
        );
    }
}
