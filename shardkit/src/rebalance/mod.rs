//! Online bucket moves of `movable` hash groups, and range splits and moves
//! of `movable` range groups.
//!
//! **The live map.** A movable group's bucket → shard map lives on its
//! control database (its first configured shard) in `shardkit_bucket_map`,
//! versioned by `shardkit_bucket_epochs`; the first instance to connect
//! seeds it from the config. Every instance reads it at connect, every
//! `[rebalance] refresh_ms`, and when a shard's fence refuses a write;
//! routing reads the map it holds without a lock
//! ([`BucketOwners`](crate::topology::BucketOwners)).
//!
//! **The fence.** Each shard holds a state per bucket
//! (`shardkit_bucket_states`: `owned`, `moving`, `moved`, `none`). Every
//! write transaction of a movable group reads its bucket's state on its
//! shard first, under a shared row lock kept to its end: a shard that does
//! not own the bucket refuses the transaction ([`ShardError::BucketMoved`]),
//! whatever map the instance holds, and [`Cluster::begin`] refreshes the map
//! and begins again on the owner. While the bucket moves away (`moving`),
//! the transaction logs its key in `shardkit_move_changes` on the same
//! shard, so the log commits exactly when the write does.
//!
//! **A move** ([`Rebalance`]): registered → copying (primary-key chunks of
//! every entity, the moving buckets' rows) → catching up (replaying the
//! logged keys: each key's rows on the target are made what the source
//! holds now) → verified (every row of the moving buckets compared; a key
//! that differs without a pending log entry is re-copied and compared again)
//! → cutting over (the sources' states become `moved`, which waits at most
//! `cutover_wait_ms` for the transactions holding their locks; the last
//! logged keys are replayed; the target's states become `owned`; the map
//! flips and its epoch is bumped) → cleaning (after `cleanup_grace_ms`, the
//! sources' rows of the moved buckets are deleted, a key's rows in one
//! statement) → done. Each phase and the copy's position are stored in
//! `shardkit_moves`, so another process resumes a move
//! ([`Rebalance::run`]) or aborts it ([`Rebalance::abort`], before the map
//! flips: the sources own the buckets again and the target's copies are
//! deleted). A bucket is held by one move at a time
//! (`shardkit_move_buckets`).
//!
//! **Fencing tokens.** Every take-over of a move raises its generation, which
//! the new mover installs on every shard the move writes before it writes
//! there; each of a mover's writes checks it in the write's own transaction,
//! so a mover paused past its hold that goes on is refused where its writes
//! land.
//!
//! **Range groups.** Each range has an id fixed for its life, which plays
//! the bucket's part in the map, the fence and the mover.
//! [`Rebalance::split_at`] replaces a range by two halves on the same shard
//! under new ids (no row is copied) and fences the old id there, so an
//! instance still routing by it is refused and rerouted;
//! [`Rebalance::plan_range`] plans the move of the range holding a key.

use crate::error::{Result, ShardError};
use crate::exec::Shards;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DbErr};
use std::time::Duration;

mod entity;
mod fencing;
mod map;
mod mover;

pub(crate) use map::{after_refusal, fence, refresh, seed_states};

/// A failed statement of the bucket-move machinery on `shard`.
pub(crate) fn db_err(shard: &str, table: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::Db {
        origin: Box::new(crate::error::Origin::table(
            crate::error::Subsystem::Rebalance,
            table,
        )),
        shard: shard.to_owned(),
        operation: format!("{operation} {table}"),
        source,
    }
}

pub use mover::{AnyGroup, MovePhase, MovePlan, MoveProgress, MoveStatus, RangeSplit, Rebalance};

/// How long [`Cluster::begin`](crate::Cluster::begin) keeps trying when a
/// fence refuses and the refreshed map still names the same shard (a
/// cut-over in progress): past a mover's hold, so that a mover that died
/// with the sources fenced can be taken over by another process before the
/// writes it holds back fail.
pub(crate) const REROUTE_FOR: Duration = Duration::from_millis(mover::LEASE_MS as u64 + 5_000);

/// Reads every movable group's map (seeding it on first use) and gives every
/// shard its bucket states. A group whose tables do not exist yet (a cluster
/// not migrated) keeps the configured spread until the next refresh.
pub(crate) async fn load_maps(shards: &Shards) -> Result<()> {
    let groups = movable_groups(shards);
    for group in groups {
        match refresh(shards, &group).await {
            Ok(_) => seed_states(shards, &group).await?,
            Err(e) if missing_table(&e) => {
                tracing::debug!(group, error = %e.report(), "bucket map not there yet (run migrate)");
            }
            // The control shard is down: route by the configured spread
            // (every shard's fence still refuses what it does not own) and
            // read the map at the next refresh.
            Err(e) if e.kind() == crate::ErrorKind::Database => {
                tracing::warn!(group, error = %e.report(), "bucket map unreadable; routing by the configured spread until the next refresh");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The movable groups' names (owned: the caller awaits between them).
fn movable_groups(shards: &Shards) -> Vec<String> {
    shards
        .topology()
        .movable_groups()
        .map(str::to_owned)
        .collect()
}

/// Whether an error says a shardkit table does not exist (a cluster not
/// migrated yet).
pub(crate) fn missing_table(e: &ShardError) -> bool {
    let text = e.report().to_string().to_ascii_lowercase();
    text.contains("no such table")
        || text.contains("does not exist")
        || text.contains("doesn't exist")
}

/// Refreshes every movable group's map (the periodic pass).
pub(crate) async fn refresh_all(shards: &Shards) {
    let groups = movable_groups(shards);
    for group in groups {
        let first = shards
            .topology()
            .live_owners(&group)
            .ok()
            .flatten()
            .is_some_and(|map| map.epoch() == 0);
        let result = if first {
            load_maps(shards).await
        } else {
            refresh(shards, &group).await.map(drop)
        };
        if let Err(e) = result {
            tracing::warn!(group, error = %e.report(), "bucket map refresh failed");
        }
    }
}

/// How many moves of `group` are not finished (0 for a group that is not
/// movable): work that writes a group's rows outside its write
/// transactions (a rollout backfill) waits for them.
pub(crate) async fn unfinished_moves(shards: &Shards, group: &str) -> Result<u64> {
    if !shards.topology().is_movable(group) {
        return Ok(0);
    }
    let id = map::control(shards, group)?;
    let (db, name) = (shards.side_conn(id), shards.shard_name(id));
    let stmt = Query::select()
        .expr_as(Expr::col(Alias::new("id")).count(), Alias::new("n"))
        .from(Alias::new("shardkit_moves"))
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .and_where(Expr::col(Alias::new("phase")).is_not_in(["done", "aborted"]))
        .to_owned();
    let n: i64 = db
        .query_one(&stmt)
        .await
        .map_err(|e| db_err(name, "shardkit_moves", "read", e))?
        .and_then(|r| r.try_get("", "n").ok())
        .unwrap_or(0);
    Ok(n as u64)
}

/// The moves of `group` as a multi-shard count or projection needs to
/// know them: how many are not finished, and the newest move's id (a move
/// registered while the read ran changes it).
pub(crate) async fn move_mark(shards: &Shards, group: &str) -> Result<(u64, i64)> {
    let id = map::control(shards, group)?;
    let (db, name) = (shards.side_conn(id), shards.shard_name(id));
    let err = |e| db_err(name, "shardkit_moves", "read", e);
    // COUNT skips the NULL of a finished move's CASE.
    let unfinished = Expr::case(
        Expr::col(Alias::new("phase")).is_not_in(["done", "aborted"]),
        1,
    );
    let stmt = Query::select()
        .expr_as(Expr::expr(unfinished).count(), Alias::new("n"))
        .expr_as(Expr::col(Alias::new("id")).max(), Alias::new("newest"))
        .from(Alias::new("shardkit_moves"))
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .to_owned();
    let row = db.query_one(&stmt).await.map_err(err)?;
    let get = |column: &str| -> Result<i64> {
        match &row {
            Some(r) => Ok(r
                .try_get::<Option<i64>>("", column)
                .map_err(err)?
                .unwrap_or(0)),
            None => Ok(0),
        }
    };
    Ok((get("n")? as u64, get("newest")?))
}

/// Whether a read of `group` must read the bucket map first: the map this
/// instance holds was read longer ago than half the cleanup grace, so the
/// shard it names may have given the bucket away and deleted its rows
/// (an instance with periodic refresh off, or one whose refreshes failed).
/// Reads then refresh first and are routed by the new map: a read never
/// finds a cleaned source.
pub(crate) fn read_needs_refresh(shards: &Shards, group: &str) -> bool {
    if !shards.topology().is_movable(group) {
        return false;
    }
    let Ok(Some(owners)) = shards.topology().live_owners(group) else {
        return false;
    };
    let half_grace = shards.rebalance_settings().cleanup_grace.as_millis() as i64 / 2;
    shards.now_ms() - owners.read_at_ms() > half_grace
}
