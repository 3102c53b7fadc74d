//! Catching up: the logged keys replayed from a consistent snapshot of
//! each source, and the comparison of source and target.

use crate::error::Result;
use crate::rebalance::db_err;
use crate::rebalance::fencing::Token;
use crate::rebalance::map::CHANGES;
use crate::rebalance::mover::{MoveStatus, Rebalance};
use crate::topology::ShardId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend};

impl<G> Rebalance<G> {
    pub(super) async fn pending(&self, status: &MoveStatus) -> Result<u64> {
        let mut total = 0u64;
        for (src, _) in self.sources(status)? {
            let (db, name) = self.conn(src);
            let stmt = Query::select()
                .expr_as(Expr::col(Alias::new("seq")).count(), Alias::new("n"))
                .from(Alias::new(CHANGES))
                .and_where(Expr::col(Alias::new("move_id")).eq(status.id))
                .to_owned();
            let n: i64 = db
                .query_one(&stmt)
                .await
                .map_err(|e| db_err(name, CHANGES, "read", e))?
                .and_then(|r| r.try_get("", "n").ok())
                .unwrap_or(0);
            total += n as u64;
        }
        Ok(total)
    }

    /// Makes the target's rows of `keys` what the source holds now: every
    /// entity's rows written (parents first), then the rows the source no
    /// longer has deleted (children first), all read in one snapshot of the
    /// source (writers that add a parent and its children meanwhile would
    /// otherwise hand the target a child without its parent).
    pub(super) async fn sync_keys(
        &self,
        token: &Token,
        source: (&DatabaseConnection, &str),
        target: (&DatabaseConnection, &str),
        keys: &[String],
    ) -> Result<()> {
        let err = |e| db_err(source.1, CHANGES, "read a snapshot of", e);
        let snapshot = match source.0.get_database_backend() {
            // A deferred transaction reads one snapshot (WAL).
            DbBackend::Sqlite => crate::exec::begin_pooled_with(source.0, Default::default()).await,
            _ => {
                let options = sea_orm::TransactionOptions {
                    isolation_level: Some(sea_orm::IsolationLevel::RepeatableRead),
                    access_mode: Some(sea_orm::AccessMode::ReadOnly),
                    ..Default::default()
                };
                crate::exec::begin_pooled_with(source.0, options).await
            }
        }
        .map_err(err)?;
        let src = (&snapshot, source.1);
        for entity in &self.entities {
            self.timed(target.1, entity.upsert_keys(token, src, target, keys))
                .await?;
        }
        for entity in self.entities.iter().rev() {
            self.timed(target.1, entity.prune_keys(token, src, target, keys))
                .await?;
        }
        snapshot.rollback().await.map_err(err)
    }

    /// Replays up to `limit` logged keys per source (all of them when
    /// `None`); returns how many log entries it consumed.
    pub(super) async fn replay(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        limit: Option<u64>,
    ) -> Result<u64> {
        let target = self.conn(self.shard_id(&status.target)?);
        let mut consumed = 0u64;
        for (src, _) in self.sources(status)? {
            let source = self.conn(src);
            let (db, name) = source;
            let err = |e| db_err(name, CHANGES, "replay", e);
            let mut done_here = 0u64;
            loop {
                let batch = limit.map_or(1_000, |l| Ord::min(l.saturating_sub(done_here), 1_000));
                if batch == 0 {
                    break;
                }
                let stmt = Query::select()
                    .columns([Alias::new("seq"), Alias::new("key_text")])
                    .from(Alias::new(CHANGES))
                    .and_where(Expr::col(Alias::new("move_id")).eq(status.id))
                    .order_by(Alias::new("seq"), sea_orm::sea_query::Order::Asc)
                    .limit(batch)
                    .to_owned();
                let rows = db.query_all(&stmt).await.map_err(err)?;
                if rows.is_empty() {
                    break;
                }
                let mut seqs = Vec::with_capacity(rows.len());
                let mut keys = Vec::with_capacity(rows.len());
                for row in &rows {
                    seqs.push(row.try_get::<i64>("", "seq").map_err(err)?);
                    keys.push(row.try_get::<String>("", "key_text").map_err(err)?);
                }
                keys.sort();
                keys.dedup();
                self.sync_keys(token, source, target, &keys).await?;
                let delete = Query::delete()
                    .from_table(Alias::new(CHANGES))
                    .and_where(Expr::col(Alias::new("seq")).is_in(seqs.iter().copied()))
                    .to_owned();
                let txn = token.begin(source, "log").await?;
                txn.execute(&delete).await.map_err(err)?;
                txn.commit().await.map_err(err)?;
                let n = seqs.len() as u64;
                done_here += n;
                consumed += n;
                status.changes_applied += keys.len() as u64;
                crate::metrics::move_applied(self.group, keys.len() as u64);
                if (n as u64) < batch {
                    break;
                }
            }
        }
        Ok(consumed)
    }

    /// Compares every moving bucket's rows; a key that differs and has no
    /// logged change pending is copied again and compared again.
    pub(super) async fn compare(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
        chunk: u64,
    ) -> Result<()> {
        let dst = self.conn(target);
        for (src, buckets) in self.sources(status)? {
            let only_here = self.moving(&buckets).await?;
            let source = self.conn(src);
            let step = self.shards.rebalance_settings().step_timeout;
            for entity in &self.entities {
                let compare = || entity.compare(source, dst, chunk, &only_here, step);
                let found = compare().await?;
                if found.keys.is_empty() {
                    continue;
                }
                let pending = self.pending_keys(source, status.id).await?;
                let unexplained: Vec<String> = found
                    .keys
                    .into_iter()
                    .filter(|k| !pending.contains(k))
                    .collect();
                if unexplained.is_empty() {
                    continue;
                }
                tracing::warn!(
                    group = self.group,
                    id = status.id,
                    table = %entity.table(),
                    keys = unexplained.len(),
                    "rows differ without a logged change: copying them again"
                );
                self.sync_keys(token, source, dst, &unexplained).await?;
                let again = compare().await?;
                let pending = self.pending_keys(source, status.id).await?;
                let still = again.keys.iter().filter(|k| !pending.contains(*k)).count();
                if still > 0 {
                    return Err(self.refuse(
                        Some(status.id),
                        format!("{still} keys of `{}` still differ between `{}` and `{}` after copying them again: something writes the source without shardkit", entity.table(), source.1, dst.1),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) async fn pending_keys(
        &self,
        source: (&DatabaseConnection, &str),
        id: i64,
    ) -> Result<std::collections::HashSet<String>> {
        let stmt = Query::select()
            .column(Alias::new("key_text"))
            .from(Alias::new(CHANGES))
            .and_where(Expr::col(Alias::new("move_id")).eq(id))
            .to_owned();
        let rows = source
            .0
            .query_all(&stmt)
            .await
            .map_err(|e| db_err(source.1, CHANGES, "read", e))?;
        Ok(rows
            .iter()
            .filter_map(|r| r.try_get::<String>("", "key_text").ok())
            .collect())
    }
}
