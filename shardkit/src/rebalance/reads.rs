//! The bucket moves' read guard ([`MoveReads`]): what a read of a
//! `movable` group awaits before it is routed, and the move mark a
//! multi-shard count or projection compares before and after its gather.

use crate::exec::Shards;
use crate::read::{MoveMark, ReadFrom, ReadGuard};
use crate::rebalance::live::{move_mark, read_needs_refresh};
use crate::rebalance::map;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::time::Duration;

/// Reads of `movable` groups: a bucket map read too long ago is read again
/// before a read is routed by it; a count or projection gets the group's
/// move mark, bounded like a read of the shard it asks.
pub(crate) struct MoveReads {
    shards: Shards,
    /// Map reads for sessions ahead of this instance's map, one at a time
    /// (the reads that waited find the map read); per group, the epoch
    /// the last session found ahead of the control database, and when.
    behind: tokio::sync::Mutex<HashMap<&'static str, (u64, i64)>>,
}

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
            behind: tokio::sync::Mutex::default(),
        }
    }

    /// How long a read of the control database may take for a read.
    fn within(&self) -> Duration {
        self.shards.read_settings().control_bound()
    }

    /// Reads the map of `group` again, its statements on the control
    /// database within `within` (a control database that accepts and never
    /// answers holds no read; installing a newer map then raises the
    /// replicas' floors under their own bound); the epoch it holds. The
    /// attempt counts as the map's read even when the control shard's
    /// breaker refuses it, as a failed refresh does.
    async fn refresh_within(
        &self,
        group: &'static str,
        within: Duration,
    ) -> crate::error::Result<u64> {
        map::live_map(&self.shards, group)?.mark_read(self.shards.now_ms());
        let control = map::control(&self.shards, group)?;
        let read = self
            .shards
            .bounded(
                control,
                group,
                Some(within),
                map::read_map(&self.shards, group, map::Seed::Never),
            )
            .await?;
        map::install_map(&self.shards, group, read).await
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
        // (A timeout too large for the clock bounds nothing.)
        let deadline = tokio::time::Instant::now()
            .checked_add(within)
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400 * 365));
        let Ok(mut behind) = tokio::time::timeout_at(deadline, self.behind.lock()).await else {
            let control = crate::rebalance::map::control(&self.shards, group)?;
            return Err(crate::ShardError::Timeout {
                group,
                shard: self.shards.shard_name(control).to_owned(),
                after: within,
            });
        };
        if self.epoch(group).is_some_and(|have| have >= seen) {
            return Ok(());
        }
        let now_ms = self.shards.now_ms();
        // Only a session at or past the one found ahead of the control
        // database is spared the map read: a session below it may be a
        // real commit's after a cut-over.
        if behind
            .get(group)
            .is_some_and(|&(ahead, at)| seen >= ahead && now_ms - at < BEHIND_FOR_MS)
        {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let now = self
            .refresh_within(group, left)
            .await
            .map_err(|e| e.timed_out_after(within))?;
        if now < seen {
            let known = behind.insert(group, (seen, now_ms));
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
            return Some(Box::pin(self.catch_up(group, seen, within)));
        }
        // A map read so long ago that its shards may have cleaned what it
        // routes to: read again, within the read's timeout; a read that
        // cannot goes on by the map it has (as when the refresh fails).
        read_needs_refresh(&self.shards, group).then(|| {
            Box::pin(async move {
                if let Err(e) = self.refresh_within(group, within).await {
                    tracing::warn!(group, error = %e.report(), "bucket map refresh before a read failed");
                }
                Ok(())
            }) as BoxFuture<'_, crate::error::Result<()>>
        })
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
