//! A rollout's shared state: its row in `shardkit_rollouts`.

use super::*;

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
    ShardError::Db {
        origin: Box::new(crate::error::Origin::table(
            crate::error::Subsystem::Rollout,
            STATE_TABLE,
        )),
        shard: shard.to_owned(),
        operation: format!("{operation} {STATE_TABLE}"),
        source,
    }
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
