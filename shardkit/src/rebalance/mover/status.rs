//! What a move looks like from outside: listing moves, one move's status,
//! and the sources it reads.

use crate::error::Result;
use crate::rebalance::mover::MOVES;
use crate::rebalance::{MovePhase, MoveStatus, Rebalance, db_err};
use crate::topology::ShardId;
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};

impl<G> Rebalance<G> {
    /// Every move of the group that is not finished, and the finished ones
    /// too when `all`.
    pub async fn list(&self, all: bool) -> Result<Vec<MoveStatus>> {
        let (db, name) = self.control_db()?;
        let mut select = Query::select();
        select
            .column(Alias::new("id"))
            .from(Alias::new(MOVES))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group));
        if !all {
            select.and_where(
                Expr::col(Alias::new("phase"))
                    .is_not_in([MovePhase::Done.as_str(), MovePhase::Aborted.as_str()]),
            );
        }
        select.order_by(Alias::new("id"), sea_orm::sea_query::Order::Asc);
        let rows = db
            .query_all(&select)
            .await
            .map_err(|e| db_err(name, MOVES, "read", e))?;
        let mut out = Vec::new();
        for row in rows {
            let id: i64 = row
                .try_get("", "id")
                .map_err(|e| db_err(name, MOVES, "read", e))?;
            out.push(self.status(id).await?);
        }
        Ok(out)
    }

    /// Move `id` as stored, with its pending changes counted.
    pub async fn status(&self, id: i64) -> Result<MoveStatus> {
        let mut status = self.read(id).await?.0;
        if !status.phase.is_finished() {
            status.pending_changes = self.pending(&status).await?;
        }
        Ok(status)
    }

    pub(super) async fn read(&self, id: i64) -> Result<(MoveStatus, Option<String>)> {
        let (db, name) = self.control_db()?;
        let err = |e| db_err(name, MOVES, "read", e);
        let stmt = Query::select()
            .columns(
                [
                    "grp",
                    "target",
                    "buckets",
                    "phase",
                    "cursor",
                    "rows_copied",
                    "changes_applied",
                    "cutover_ms",
                    "error",
                    "tables",
                    "generation",
                ]
                .map(Alias::new),
            )
            .from(Alias::new(MOVES))
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .to_owned();
        let row = db
            .query_one(&stmt)
            .await
            .map_err(err)?
            .ok_or_else(|| self.refuse(Some(id), "no such move"))?;
        let group: String = row.try_get("", "grp").map_err(err)?;
        if group != self.group {
            return Err(self.refuse(Some(id), format!("the move is of group `{group}`")));
        }
        let tables: String = row.try_get("", "tables").map_err(err)?;
        if tables != self.tables() {
            return Err(self.refuse(
                Some(id),
                format!(
                    "the move carries the tables [{tables}] in this order, this mover lists [{}]: list the same entities in the same order",
                    self.tables()
                ),
            ));
        }
        let phase: String = row.try_get("", "phase").map_err(err)?;
        let buckets: String = row.try_get("", "buckets").map_err(err)?;
        let buckets = buckets
            .split(',')
            .filter_map(|p| {
                let (b, s) = p.split_once(':')?;
                Some((b.parse().ok()?, s.to_owned()))
            })
            .collect();
        let status = MoveStatus {
            id,
            group,
            target: row.try_get("", "target").map_err(err)?,
            buckets,
            phase: MovePhase::parse(&phase)
                .ok_or_else(|| self.refuse(Some(id), format!("unknown phase {phase:?}")))?,
            rows_copied: row.try_get::<i64>("", "rows_copied").map_err(err)? as u64,
            changes_applied: row.try_get::<i64>("", "changes_applied").map_err(err)? as u64,
            pending_changes: 0,
            cutover_ms: row.try_get("", "cutover_ms").map_err(err)?,
            error: row.try_get("", "error").map_err(err)?,
            generation: row.try_get("", "generation").map_err(err)?,
        };
        Ok((status, row.try_get("", "cursor").map_err(err)?))
    }

    /// The sources, each with the moving buckets it gives.
    pub(super) fn sources(&self, status: &MoveStatus) -> Result<Vec<(ShardId, Vec<u32>)>> {
        let mut by: std::collections::BTreeMap<ShardId, Vec<u32>> = Default::default();
        for (b, s) in &status.buckets {
            by.entry(self.shard_id(s)?).or_default().push(*b);
        }
        Ok(by.into_iter().collect())
    }
}
