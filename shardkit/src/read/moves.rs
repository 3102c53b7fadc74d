//! Reads of a `movable` group while buckets move: the map a read routes
//! by, the move mark a count checks, and keeping only the rows a shard owns.

use crate::entity::ShardedEntity;
use crate::error::{Result, ShardFailure};
use crate::read::MoveMark;
use crate::read::request::Read;
use crate::read::route::Gathered;
use crate::topology::ShardId;
use sea_orm::{QuerySelect, Select};

impl<E: ShardedEntity> Read<E> {
    /// A `movable` group's map now (`None` for other groups).
    pub(super) fn map_snapshot(&self) -> Option<crate::topology::MapSnapshot> {
        let topology = self.shards.topology();
        if !topology.is_movable(Self::group()) {
            return None;
        }
        topology
            .live_owners(Self::group())
            .ok()
            .flatten()
            .map(|map| map.snapshot())
    }

    /// The group's moves as a count or projection of a plan needs them:
    /// `None` when the plan cannot see a row twice (not a scatter of a
    /// `movable` group).
    pub(super) async fn move_mark(&self, scatters_movable: bool) -> Option<MoveMark> {
        if !scatters_movable {
            return None;
        }
        match self
            .guard
            .as_ref()
            .and_then(|g| g.move_mark(Self::group(), self.timeout))
        {
            Some(asked) => Some(asked.await),
            // No guard (not a cluster's read): nothing says there is no move.
            None => Some(None),
        }
    }

    /// Counts the plan's rows, each once: whole rows of every shard, kept
    /// where the plan's map says they live, counted (no limit, offset or
    /// order applies to a count).
    pub(super) async fn count_owned(
        &self,
        parts: Vec<(ShardId, Select<E>)>,
        asked: usize,
        lookup_failed: Option<ShardFailure>,
        owners: Option<&crate::topology::MapSnapshot>,
    ) -> (Result<u64>, Gathered) {
        let parts: Vec<(ShardId, Select<E>)> = parts
            .into_iter()
            .map(|(id, select)| {
                (
                    id,
                    select
                        .select_only()
                        .columns(<E::Column as sea_orm::Iterable>::iter()),
                )
            })
            .collect();
        let (ok, mut failed, span) = self
            .gather(parts, asked, "count", |s, conn| s.all(conn))
            .await;
        let asked = asked + usize::from(lookup_failed.is_some());
        failed.extend(lookup_failed);
        let n: u64 = owned_only::<E>(ok, owners)
            .iter()
            .map(|(_, rows)| rows.len() as u64)
            .sum();
        span.record("rows", n);
        (Ok(n), self.gathered(asked, failed))
    }
}

/// For a scatter of a `movable` group, only each shard's rows of the
/// buckets `owners` (the plan's map) says it owns: while a bucket moves,
/// its rows are on the source and (copied, or not yet cleaned) on the
/// target, and a row must be read once.
pub(super) fn owned_only<E: ShardedEntity>(
    parts: Vec<(ShardId, Vec<E::Model>)>,
    owners: Option<&crate::topology::MapSnapshot>,
) -> Vec<(ShardId, Vec<E::Model>)> {
    let Some(map) = owners else {
        return parts;
    };
    parts
        .into_iter()
        .map(|(id, rows)| {
            let rows = rows
                .into_iter()
                .filter(|m| map.owner_of(&E::shard_key(m)) == Some(id))
                .collect();
            (id, rows)
        })
        .collect()
}
