//! The cluster-wide view of moves: loading and refreshing bucket maps, unfinished moves, and the errors of move statements.

use crate::error::Result;
use crate::exec::Shards;
use crate::rebalance::{db_err, map, missing_table, mover, refresh, seed_states};
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use std::time::Duration;

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
    for group in movable_groups(shards) {
        load_map(shards, &group).await?;
    }
    Ok(())
}

/// [`load_maps`] for one group.
async fn load_map(shards: &Shards, group: &str) -> Result<()> {
    match refresh(shards, group).await {
        Ok(_) => seed_states(shards, group).await?,
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
    Ok(())
}

/// The movable groups' names (owned: the caller awaits between them).
pub(super) fn movable_groups(shards: &Shards) -> Vec<String> {
    shards
        .topology()
        .movable_groups()
        .map(str::to_owned)
        .collect()
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
        // Bounded (the read timeout, at least 5 s: a whole map is read): a
        // control database that accepts and never answers must not hold
        // the refresh task for good. Only seeding a map the control
        // database does not have is not (it writes every shard's states
        // in chunks, not to be cut off midway).
        let within = shards
            .read_settings()
            .control_bound()
            .max(Duration::from_secs(5));
        let read = tokio::time::timeout(within, map::read_map(shards, &group, map::Seed::Never));
        let result = match read.await {
            Ok(Ok(read)) if read.missing && first => load_map(shards, &group).await,
            Ok(Ok(read)) => match map::install_map(shards, &group, read).await {
                // A map read for the first time: every shard's states too.
                Ok(_) if first => seed_states(shards, &group).await,
                other => other.map(drop),
            },
            Ok(Err(e)) if first && missing_table(&e) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                tracing::warn!(
                    group,
                    ?within,
                    "bucket map refresh failed: the control database did not answer"
                );
                continue;
            }
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

/// How old a `movable` group's map is for a read (see [`map_age`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapAge {
    /// Read less than half the cleanup grace ago (or not movable).
    Fresh,
    /// Read longer ago than half the grace: still safe to route by (a
    /// bucket moved since the read keeps its old rows until the grace has
    /// passed since its flip), but to be read again.
    Stale,
    /// Read longer ago than three quarters of the grace (the last quarter
    /// is the margin for the read's own time and the clocks of the instance
    /// and the mover): a bucket moved since may be cleaned by the time the
    /// read's statement runs. The map must be read before the read is
    /// routed, or the read refused.
    Expired {
        /// How long ago the map was last read (`None`: never, since the
        /// instance connected).
        age: Option<std::time::Duration>,
    },
}

/// How long ago this instance last read `group`'s map (the start of the
/// last read that succeeded: a failed or cut-off attempt does not count),
/// against the cleanup grace.
pub(crate) fn map_age(shards: &Shards, group: &str) -> MapAge {
    if !shards.topology().is_movable(group) {
        return MapAge::Fresh;
    }
    let Ok(Some(owners)) = shards.topology().live_owners(group) else {
        return MapAge::Fresh;
    };
    let grace = shards.rebalance_settings().cleanup_grace.as_millis() as i64;
    let read_at = owners.read_at_ms();
    let age = shards.now_ms() - read_at;
    if age > grace / 4 * 3 {
        MapAge::Expired {
            age: (read_at > 0)
                .then(|| std::time::Duration::from_millis(u64::try_from(age).unwrap_or(0))),
        }
    } else if age > grace / 2 {
        MapAge::Stale
    } else {
        MapAge::Fresh
    }
}
