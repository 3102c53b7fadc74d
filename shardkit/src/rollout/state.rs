//! A rollout's shared state: its row in `shardkit_rollouts`.

use crate::entity::{EntityGroup, ShardedEntity};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::phase::Phase;
use crate::rollout::RolloutInstance;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
use std::time::Duration;

pub(super) const STATE_TABLE: &str = "shardkit_rollouts";
pub(super) const BACKFILL_DONE: &str = "done";

/// A rollout's row in `shardkit_rollouts`.
#[derive(Clone, Debug)]
pub(crate) struct StateRow {
    pub(crate) phase: Phase,
    pub(crate) changed_ms: i64,
    pub(crate) gap_ms: i64,
    pub(crate) backfill: Option<String>,
    pub(crate) verify: Option<String>,
}

/// The database holding the state of group `E::Group`'s rollouts, and its name.
pub(crate) fn state_db<E: ShardedEntity>(shards: &Shards) -> Result<(&DatabaseConnection, &str)> {
    let id = shards
        .topology()
        .shards_of(<E::Group as EntityGroup>::NAME)?[0];
    Ok((shards.shard_conn(id), shards.shard_name(id)))
}

pub(super) fn state_err(shard: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::db(
        crate::error::Origin::table(crate::error::Subsystem::Rollout, STATE_TABLE),
        shard.to_owned(),
        format!("{operation} {STATE_TABLE}"),
        source,
    )
}

pub(crate) async fn read_state(
    db: &DatabaseConnection,
    shard: &str,
    name: &str,
) -> Result<Option<StateRow>> {
    let stmt = Query::select()
        .columns(["phase", "changed_ms", "gap_ms", "backfill", "verify"].map(Alias::new))
        .from(Alias::new(STATE_TABLE))
        .and_where(Expr::col(Alias::new("name")).eq(name))
        .to_owned();
    let row = db
        .query_one(&stmt)
        .await
        .map_err(|e| state_err(shard, "read", e))?;
    let Some(row) = row else { return Ok(None) };
    let get = |e| state_err(shard, "read", e);
    let phase: String = row.try_get("", "phase").map_err(get)?;
    Ok(Some(StateRow {
        phase: Phase::parse(&phase).ok_or_else(|| {
            ShardError::config(
                format!("{STATE_TABLE}[{name}]"),
                format!("unknown phase {phase:?}"),
            )
        })?,
        changed_ms: row.try_get("", "changed_ms").map_err(get)?,
        gap_ms: row.try_get("", "gap_ms").map_err(get)?,
        backfill: row.try_get("", "backfill").map_err(get)?,
        verify: row.try_get("", "verify").map_err(get)?,
    }))
}

/// Saves a progress column (`backfill` or `verify`) of a rollout.
pub(crate) async fn save_progress(
    db: &DatabaseConnection,
    shard: &str,
    name: &str,
    column: &str,
    value: Option<String>,
) -> Result<()> {
    let stmt = Query::update()
        .table(Alias::new(STATE_TABLE))
        .value(Alias::new(column), value)
        .and_where(Expr::col(Alias::new("name")).eq(name))
        .to_owned();
    db.execute(&stmt)
        .await
        .map(drop)
        .map_err(|e| state_err(shard, "update", e))
}

pub(super) const INSTANCES_TABLE: &str = "shardkit_rollout_instances";

fn instances_err(shard: &str, operation: &str, source: DbErr) -> ShardError {
    ShardError::db(
        crate::error::Origin::table(crate::error::Subsystem::Rollout, INSTANCES_TABLE),
        shard.to_owned(),
        format!("{operation} {INSTANCES_TABLE}"),
        source,
    )
}

/// One instance's row in `shardkit_rollout_instances`.
pub(super) struct InstanceRow<'a> {
    pub(super) rollout: &'a str,
    pub(super) instance: &'a str,
    pub(super) old_table: &'a str,
    pub(super) cache_ttl_ms: i64,
    pub(super) refresh_ms: i64,
    pub(super) seen_ms: i64,
}

/// Records (or renews) an instance's registration of a rollout.
pub(super) async fn register_instance(
    db: &DatabaseConnection,
    shard: &str,
    row: InstanceRow<'_>,
) -> Result<()> {
    let stmt = Query::insert()
        .into_table(Alias::new(INSTANCES_TABLE))
        .columns(
            [
                "rollout",
                "instance",
                "old_table",
                "cache_ttl_ms",
                "refresh_ms",
                "seen_ms",
            ]
            .map(Alias::new),
        )
        .values_panic([
            row.rollout.into(),
            row.instance.into(),
            row.old_table.into(),
            row.cache_ttl_ms.into(),
            row.refresh_ms.into(),
            row.seen_ms.into(),
        ])
        .on_conflict(
            OnConflict::columns([Alias::new("rollout"), Alias::new("instance")])
                .update_columns(
                    ["old_table", "cache_ttl_ms", "refresh_ms", "seen_ms"].map(Alias::new),
                )
                .to_owned(),
        )
        .to_owned();
    db.execute(&stmt)
        .await
        .map(drop)
        .map_err(|e| instances_err(shard, "register in", e))
}

/// Records that an instance re-read the phase at `seen_ms`.
pub(super) async fn instance_seen(
    db: &DatabaseConnection,
    shard: &str,
    rollout: &str,
    instance: &str,
    seen_ms: i64,
) -> Result<()> {
    let stmt = Query::update()
        .table(Alias::new(INSTANCES_TABLE))
        .value(Alias::new("seen_ms"), seen_ms)
        .and_where(Expr::col(Alias::new("rollout")).eq(rollout))
        .and_where(Expr::col(Alias::new("instance")).eq(instance))
        .to_owned();
    db.execute(&stmt)
        .await
        .map(drop)
        .map_err(|e| instances_err(shard, "update", e))
}

/// The instances that registered `rollout`, most recently seen first.
pub(super) async fn read_instances(
    db: &DatabaseConnection,
    shard: &str,
    rollout: &str,
    this_instance: &str,
) -> Result<Vec<RolloutInstance>> {
    let stmt = Query::select()
        .columns(["instance", "cache_ttl_ms", "refresh_ms", "seen_ms"].map(Alias::new))
        .from(Alias::new(INSTANCES_TABLE))
        .and_where(Expr::col(Alias::new("rollout")).eq(rollout))
        .order_by(Alias::new("seen_ms"), sea_orm::Order::Desc)
        .order_by(Alias::new("instance"), sea_orm::Order::Asc)
        .to_owned();
    let rows = db
        .query_all(&stmt)
        .await
        .map_err(|e| instances_err(shard, "read", e))?;
    let get = |e| instances_err(shard, "read", e);
    let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
    rows.iter()
        .map(|row| {
            let name: String = row.try_get("", "instance").map_err(get)?;
            Ok(RolloutInstance {
                this_instance: name == this_instance,
                name,
                cache_ttl: ms(row.try_get("", "cache_ttl_ms").map_err(get)?),
                refresh_interval: ms(row.try_get("", "refresh_ms").map_err(get)?),
                seen_ms: row.try_get("", "seen_ms").map_err(get)?,
            })
        })
        .collect()
}
