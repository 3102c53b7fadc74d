//! The bucket moves' read guard ([`MoveReads`]): what a read of a
//! `movable` group awaits before it is routed, and the move mark a
//! multi-shard count or projection compares before and after its gather.

use crate::exec::Shards;
use crate::read::{MoveMark, ReadFrom, ReadGuard};
use crate::rebalance::live::{move_mark, read_needs_refresh};
use crate::rebalance::map::refresh;
use futures::future::BoxFuture;
use std::time::Duration;

/// Reads of `movable` groups: a bucket map read too long ago is read again
/// before a read is routed by it; a count or projection gets the group's
/// move mark, bounded like a read of the shard it asks.
pub(crate) struct MoveReads {
    shards: Shards,
}

impl MoveReads {
    /// The guard over `shards` (a task's handle: it does not keep the
    /// cluster's pools open).
    pub(crate) fn new(shards: Shards) -> Self {
        MoveReads { shards }
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
    ) -> Option<BoxFuture<'_, crate::error::Result<()>>> {
        // A session that saw a newer map than this instance holds: its
        // commits may be on a bucket's new owner, which this map does not
        // name yet. Read the map first, or refuse the read.
        let have = match self.shards.topology().live_owners(group) {
            Ok(Some(map)) => map.epoch(),
            _ => return None,
        };
        if let Some(seen) = seen_epoch.filter(|seen| *seen > have) {
            return Some(Box::pin(async move {
                let now = refresh(&self.shards, group).await?;
                if now < seen {
                    return Err(crate::error::ShardError::InvalidSession {
                        reason: format!(
                            "it has seen epoch {seen} of group `{group}`'s bucket map, and the \
                             control database holds epoch {now} (a session of another cluster, \
                             or a control database restored from an older backup)"
                        ),
                    });
                }
                Ok(())
            }));
        }
        read_needs_refresh(&self.shards, group).then(|| {
            Box::pin(async move {
                if let Err(e) = refresh(&self.shards, group).await {
                    tracing::warn!(group, error = %e.report(), "bucket map refresh before a read failed");
                }
                Ok(())
            }) as BoxFuture<'_, crate::error::Result<()>>
        })
    }

    fn move_mark(&self, group: &'static str) -> Option<BoxFuture<'_, MoveMark>> {
        self.shards.topology().is_movable(group).then(|| {
            Box::pin(async move {
                let within = self
                    .shards
                    .read_settings()
                    .timeout
                    .unwrap_or(Duration::from_secs(5));
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
