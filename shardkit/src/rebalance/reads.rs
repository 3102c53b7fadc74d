//! The bucket moves' read guard ([`MoveReads`]): what a read of a
//! `movable` group awaits before it is routed, and the move mark a
//! multi-shard count or projection compares before and after its gather.

use crate::exec::Shards;
use crate::read::{MoveMark, ReadFrom, ReadGuard};
use crate::rebalance::live::{MapAge, map_age, move_mark};
use crate::rebalance::map;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Reads of `movable` groups: a bucket map read too long ago is read again
/// (in the background while it is still safe to route by, before the read
/// once it is not); a count or projection gets the group's move mark,
/// bounded like a read of the shard it asks.
pub(crate) struct MoveReads {
    shards: Shards,
    /// Per group: the map reads that reads wait for, one at a time (the
    /// reads that waited find the map read, or its failure).
    groups: std::sync::Mutex<HashMap<&'static str, Arc<tokio::sync::Mutex<GroupReads>>>>,
}

/// What a group's reads learnt from the map reads made for them.
#[derive(Default)]
struct GroupReads {
    /// The epoch the last session found ahead of the control database,
    /// and when.
    behind: Option<(u64, i64)>,
    /// The last map read for an expired map that failed (the reads that
    /// waited for it are refused with it).
    failed: Option<Failed>,
}

/// A failed map read for an expired map.
struct Failed {
    /// When it began.
    at: tokio::time::Instant,
    /// The time it had.
    had: Duration,
    /// Why it failed.
    cause: String,
}

/// How often a stale map (still safe to route by) is tried again in the
/// background after an attempt.
const STALE_RETRY_MS: i64 = 1_000;

/// For how long a control database found below a session's map epoch is
/// not asked again for a session ahead of it (a session of another
/// cluster, a control database restored from a backup, or a made-up
/// session text would otherwise send every read's map read to it).
const BEHIND_FOR_MS: i64 = 1_000;

impl MoveReads {
    /// The guard over `shards` (a task's handle: it does not keep the
    /// cluster's pools open).
    pub(crate) fn new(shards: Shards) -> Self {
        MoveReads {
            shards,
            groups: std::sync::Mutex::default(),
        }
    }

    /// `group`'s map reads for reads.
    fn group(&self, group: &'static str) -> Arc<tokio::sync::Mutex<GroupReads>> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(groups.entry(group).or_default())
    }

    /// Waits for `group`'s map reads until `deadline`; `Err`: the deadline
    /// passed first (a `Timeout` naming the control shard, `within` long).
    async fn lock_group(
        &self,
        group: &'static str,
        deadline: tokio::time::Instant,
        within: Duration,
    ) -> crate::error::Result<tokio::sync::OwnedMutexGuard<GroupReads>> {
        match tokio::time::timeout_at(deadline, self.group(group).lock_owned()).await {
            Ok(guard) => Ok(guard),
            Err(_) => {
                let control = map::control(&self.shards, group)?;
                Err(crate::ShardError::Timeout {
                    group,
                    shard: self.shards.shard_name(control).to_owned(),
                    after: within,
                })
            }
        }
    }

    /// How long a read of the control database may take for a read.
    fn within(&self) -> Duration {
        self.shards.read_settings().control_bound()
    }

    /// Reads an expired map of `group` before a read is routed by it
    /// (one read at a time; a read that waited finds the map read by one
    /// that began after it did, or is refused with the failure of one that
    /// began after it did with at least its time); `Err`: the read is
    /// refused ([`crate::ShardError::BucketMapExpired`], or the map's own
    /// error when it is not the control database's answer that failed).
    async fn renew(
        &self,
        group: &'static str,
        age: Option<Duration>,
        within: Duration,
    ) -> crate::error::Result<()> {
        let began = tokio::time::Instant::now();
        let began_ms = self.shards.now_ms();
        let deadline = deadline_after(within);
        let control = self.shards.shard_name(map::control(&self.shards, group)?);
        let expired = |cause: String| crate::ShardError::BucketMapExpired {
            group,
            age,
            grace: self.shards.rebalance_settings().cleanup_grace,
            cause,
        };
        let Ok(mut reads) = tokio::time::timeout_at(deadline, self.group(group).lock_owned()).await
        else {
            return Err(expired(format!(
                "another read's map read on the control database `{control}` did not end within \
                 {within:?}"
            )));
        };
        let map = map::live_map(&self.shards, group)?;
        // A map read that began since this read did is as good as its own
        // (with a grace of 0 the map is expired again a moment later).
        if map.read_at_ms() >= began_ms
            || !matches!(map_age(&self.shards, group), MapAge::Expired { .. })
        {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if let Some(failed) = &reads.failed
            && failed.at >= began
            && failed.had >= left
        {
            return Err(expired(failed.cause.clone()));
        }
        let at = tokio::time::Instant::now();
        let (cause, refused) = match refresh_within(&self.shards, group, left).await {
            // Read, unless the control database holds an older map than
            // this instance, or none (see `map::install_map`).
            Ok(installed) if installed.read => {
                reads.failed = None;
                return Ok(());
            }
            Ok(_) => {
                let cause = format!(
                    "the control database `{control}` holds no bucket map as new as this \
                     instance's (epoch {}): restored or failed over to an older copy?",
                    map.epoch()
                );
                (cause.clone(), expired(cause))
            }
            // Not the control database's answer: the map itself is wrong
            // for this instance (a shard its config lacks), which waiting
            // does not mend; the reads that waited are refused with it.
            Err(e) if e.kind() != crate::ErrorKind::Database => (e.report().to_string(), e),
            Err(e) => {
                let cause = e.timed_out_after(left).report().to_string();
                (cause.clone(), expired(cause))
            }
        };
        // Logged once a second at most (a breaker refusing at once would
        // log every read's).
        if reads
            .failed
            .as_ref()
            .is_none_or(|f| at.duration_since(f.at) >= Duration::from_secs(1))
        {
            tracing::warn!(group, ?age, error = %cause, "bucket map expired and unreadable: reads of the group are refused");
        }
        reads.failed = Some(Failed {
            at,
            had: left,
            cause,
        });
        Err(refused)
    }

    fn epoch(&self, group: &str) -> Option<u64> {
        match self.shards.topology().live_owners(group) {
            Ok(Some(map)) => Some(map.epoch()),
            _ => None,
        }
    }

    /// Reads the map of `group` for a session that has seen epoch `seen`,
    /// within `within` (the read's timeout), the wait for another read's
    /// catch-up included.
    async fn catch_up(
        &self,
        group: &'static str,
        seen: u64,
        within: Duration,
    ) -> crate::error::Result<()> {
        let deadline = deadline_after(within);
        let mut reads = self.lock_group(group, deadline, within).await?;
        if self.epoch(group).is_some_and(|have| have >= seen) {
            return Ok(());
        }
        let now_ms = self.shards.now_ms();
        // Only a session at or past the one found ahead of the control
        // database is spared the map read: a session below it may be a
        // real commit's after a cut-over.
        if reads
            .behind
            .is_some_and(|(ahead, at)| seen >= ahead && now_ms - at < BEHIND_FOR_MS)
        {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let now = refresh_within(&self.shards, group, left)
            .await
            .map_err(|e| e.timed_out_after(within))?
            .epoch;
        if now < seen {
            let known = reads.behind.replace((seen, now_ms));
            if known.is_none() {
                tracing::warn!(
                    group,
                    session = seen,
                    control = now,
                    "a session has seen a newer bucket map than the control database holds \
                     (a session of another cluster, or a control database restored or failed \
                     over to an older copy): reads are routed by the control database's map"
                );
            }
        }
        Ok(())
    }
}

/// `within` from now (a timeout too large for the clock bounds nothing).
fn deadline_after(within: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(within)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// Reads the map of `group` again, its statements on the control database
/// within `within` (a control database that accepts and never answers
/// holds no read; installing a newer map then raises the replicas' floors
/// under their own bound). Only a read that succeeds counts as the map's
/// read (see [`map::Installed`]).
async fn refresh_within(
    shards: &Shards,
    group: &'static str,
    within: Duration,
) -> crate::error::Result<map::Installed> {
    let control = map::control(shards, group)?;
    let read = shards
        .bounded(
            control,
            group,
            Some(within),
            map::read_map(shards, group, map::Seed::Never),
        )
        .await?;
    map::install_map(shards, group, read).await
}

impl ReadGuard for MoveReads {
    fn check(
        &self,
        _entity: std::any::TypeId,
        _table: &'static str,
    ) -> crate::error::Result<Option<ReadFrom>> {
        Ok(None)
    }

    fn before_routing(
        &self,
        group: &'static str,
        seen_epoch: Option<u64>,
        timeout: Option<Duration>,
    ) -> Option<BoxFuture<'_, crate::error::Result<()>>> {
        let within = timeout.unwrap_or_else(|| self.within());
        // A session that saw a newer map than this instance holds: its
        // commits may be on a bucket's new owner, which this map does not
        // name yet. Read the map first; a read that cannot is refused.
        // (Only reads with a session look: routing is on every read.)
        if let Some(seen) = seen_epoch
            && self.shards.topology().is_movable(group)
            && self.epoch(group).is_some_and(|have| seen > have)
        {
            return Some(Box::pin(async move {
                let deadline = deadline_after(within);
                self.catch_up(group, seen, within).await?;
                // (A control database behind the session leaves the map
                // as it was: it may still be expired.)
                match map_age(&self.shards, group) {
                    MapAge::Expired { age } => {
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        self.renew(group, age, left).await
                    }
                    _ => Ok(()),
                }
            }));
        }
        match map_age(&self.shards, group) {
            MapAge::Fresh => None,
            // Still safe to route by: read again in the background (one
            // read at a time, a second apart at least) while this read
            // goes on.
            MapAge::Stale => {
                let map = map::live_map(&self.shards, group).ok()?;
                if map.reads().claim_try(self.shards.now_ms(), STALE_RETRY_MS) {
                    let within = self.within();
                    // Ends the read however its task ends.
                    let trying = map::map_claim(&self.shards, group, |reads| {
                        reads.done_trying();
                    });
                    crate::exec::periodic::spawn_once(
                        &self.shards,
                        move |shards: Shards| async move {
                            let _trying = trying;
                            if let Err(e) = refresh_within(&shards, group, within).await {
                                tracing::warn!(group, error = %e.report(), "bucket map refresh failed");
                            }
                        },
                    );
                }
                None
            }
            // A map read so long ago that its shards may have cleaned what
            // it routes to: read it first, within the read's timeout, or
            // refuse the read.
            MapAge::Expired { age } => Some(Box::pin(self.renew(group, age, within))),
        }
    }

    fn move_mark(
        &self,
        group: &'static str,
        timeout: Option<Duration>,
    ) -> Option<BoxFuture<'_, MoveMark>> {
        self.shards.topology().is_movable(group).then(|| {
            Box::pin(async move {
                let within = timeout.unwrap_or_else(|| self.within());
                match tokio::time::timeout(within, move_mark(&self.shards, group)).await {
                    Ok(Ok(mark)) => Some(mark),
                    Ok(Err(e)) => {
                        tracing::warn!(group, error = %e.report(), "moves unknown: counting rows one by one, refusing projections");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(group, ?within, "moves unknown (control database slow): counting rows one by one, refusing projections");
                        None
                    }
                }
            }) as BoxFuture<'_, MoveMark>
        })
    }
}
