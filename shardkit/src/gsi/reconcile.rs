//! Reconciliation: removing dangling index rows past the grace period and
//! adding rows for owners that have none, once or periodically.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::{Shards, keyset};
use crate::gsi::{
    Gsi, IndexDef, RECONCILE_CHUNK, ReconcileConflict, ReconcileReport, Removal, gsi_err,
};
use crate::job::JobControl;
use crate::key::{model_pk, typed_value, value_text};
use sea_orm::sea_query::{Alias, Expr, Query};
use sea_orm::{ConnectionTrait, ExprTrait, ModelTrait, Value};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

impl Gsi {
    /// Removes dangling index rows of `E` older than the grace period and adds
    /// index rows for owners that have none. Run it periodically
    /// ([`reconcile_every`](Self::reconcile_every)).
    pub async fn reconcile<E: ShardedEntity>(&self) -> Result<ReconcileReport> {
        self.reconcile_with::<E>(JobControl::new()).await
    }

    /// [`reconcile`](Self::reconcile) with a [`JobControl`]: its progress
    /// callback is called with the report so far after every chunk of index
    /// rows or primary rows scanned. Once its token is cancelled the pass
    /// stops at the next chunk boundary (the dangling rows already found are
    /// removed first) and returns what it did (`finished: false`). A pass
    /// saves no position, unlike the backfills: it repairs what it finds and
    /// the next pass starts over, which is what a periodic pass does anyway.
    pub async fn reconcile_with<E: ShardedEntity>(
        &self,
        control: JobControl<ReconcileReport>,
    ) -> Result<ReconcileReport> {
        let report = self.reconcile_pass::<E>(&control).await?;
        crate::metrics::reconciled(table_name::<E>(), report.removed, report.added);
        Ok(report)
    }

    async fn reconcile_pass<E: ShardedEntity>(
        &self,
        control: &JobControl<ReconcileReport>,
    ) -> Result<ReconcileReport> {
        let grace = self.state.grace.as_millis() as i64;
        let mut report = ReconcileReport::default();
        for (column, unique) in E::GLOBAL_INDEXES {
            let index = IndexDef::of::<E>(*column, *unique);
            for id in self.group_shards(<E::Group as EntityGroup>::NAME)? {
                let (db, shard) = self.conn(id);
                let err = |e| gsi_err(shard, &index.table, format!("reconcile {}", index.table), e);
                let mut after: Vec<Value> = Vec::new();
                let mut dangling = Vec::new();
                const COLUMNS: [&str; 3] = ["value", "shard_key", "owner_pk"];
                let mut cancelled = false;
                loop {
                    if control.is_cancelled() {
                        cancelled = true;
                        break;
                    }
                    let stmt = Query::select()
                        .columns(["value", "shard_key", "owner_pk", "created_ms"].map(Alias::new))
                        .from(Alias::new(index.table.as_str()))
                        .cond_where(keyset::after_columns(&COLUMNS, &after))
                        .order_by(Alias::new("value"), sea_orm::Order::Asc)
                        .order_by(Alias::new("shard_key"), sea_orm::Order::Asc)
                        .order_by(Alias::new("owner_pk"), sea_orm::Order::Asc)
                        .limit(RECONCILE_CHUNK)
                        .to_owned();
                    let rows = db.query_all(&stmt).await.map_err(err)?;
                    for row in &rows {
                        report.scanned += 1;
                        let value: String = row.try_get("", "value").map_err(err)?;
                        let key: String = row.try_get("", "shard_key").map_err(err)?;
                        let owner: String = row.try_get("", "owner_pk").map_err(err)?;
                        let created: i64 = row.try_get("", "created_ms").map_err(err)?;
                        after = vec![
                            value.clone().into(),
                            key.clone().into(),
                            owner.clone().into(),
                        ];
                        if self.shards.now_ms() - created < grace {
                            continue; // an insert may still be in flight
                        }
                        let typed = typed_value::<E>(*column, &value);
                        if !self.owner_alive::<E>(&index, &key, &typed).await? {
                            dangling.push(Removal {
                                shard: id,
                                index: index.clone(),
                                value,
                                key,
                                owner,
                                version: created,
                            });
                        }
                    }
                    control.report(&report);
                    if (rows.len() as u64) < RECONCILE_CHUNK {
                        break;
                    }
                }
                for removal in &dangling {
                    report.removed += self.remove_entry(removal).await?;
                }
                if cancelled {
                    control.report(&report);
                    return Ok(report);
                }
            }
            // Owners without an index row.
            for id in self.owner_shards(<E::Group as EntityGroup>::NAME)? {
                let (db, shard) = self.conn(id);
                let mut after: Option<Vec<Value>> = None;
                loop {
                    if control.is_cancelled() {
                        return Ok(report);
                    }
                    let rows = keyset::chunk::<E>(after.as_deref(), RECONCILE_CHUNK)
                        .all(db)
                        .await
                        .map_err(|e| {
                            gsi_err(shard, &index.table, format!("reconcile {}", index.table), e)
                        })?;
                    if let Some(last) = rows.last() {
                        after = Some(keyset::model_pk_values::<E>(last));
                    }
                    let read = rows.len() as u64;
                    for row in rows {
                        let value = row.get(*column);
                        let Some(text) = value_text(&value) else {
                            continue;
                        };
                        let key = E::shard_key(&row).to_directory_text();
                        if !self.entry_exists::<E>(&index, &text, &key).await? {
                            let owner = model_pk::<E>(&row);
                            match self.write_entry::<E>(&index, &value, &key, &owner).await {
                                Ok(()) => report.added += 1,
                                // Another live owner holds the value: two rows
                                // claim one unique value. Report it and go on.
                                Err(ShardError::UniqueViolation { .. }) => {
                                    report.conflicts.push(ReconcileConflict {
                                        index: index.table.clone(),
                                        value: text,
                                        key,
                                        owner,
                                    });
                                }
                                Err(e) => return Err(e),
                            }
                        }
                    }
                    control.report(&report);
                    if read < RECONCILE_CHUNK {
                        break;
                    }
                }
            }
        }
        report.finished = true;
        Ok(report)
    }

    pub(super) async fn entry_exists<E: ShardedEntity>(
        &self,
        index: &IndexDef,
        value: &str,
        key: &str,
    ) -> Result<bool> {
        let id = self.index_shard(<E::Group as EntityGroup>::NAME, index, value)?;
        let (db, shard) = self.conn(id);
        let stmt = Query::select()
            .expr(Expr::val(1))
            .from(Alias::new(index.table.as_str()))
            .and_where(Expr::col(Alias::new("value")).eq(value))
            .and_where(Expr::col(Alias::new("shard_key")).eq(key))
            .to_owned();
        Ok(db
            .query_one(&stmt)
            .await
            .map_err(|e| gsi_err(shard, &index.table, format!("check {}", index.table), e))?
            .is_some())
    }

    /// Runs [`reconcile`](Self::reconcile) every `interval` (the first pass at
    /// once) until the handle is aborted or the cluster is dropped (the task
    /// does not keep the cluster alive); each pass's report (or error) is
    /// logged.
    pub fn reconcile_every<E: ShardedEntity>(
        &self,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let state = Arc::clone(&self.state);
        crate::exec::periodic::spawn(
            &self.shards,
            interval,
            crate::exec::periodic::FirstPass::Now,
            move |shards: Shards| {
                let state = Arc::clone(&state);
                async move {
                    match Gsi::new(&shards, &state).reconcile::<E>().await {
                        Ok(report) => tracing::info!(
                            table = table_name::<E>(),
                            scanned = report.scanned,
                            removed = report.removed,
                            added = report.added,
                            conflicts = report.conflicts.len(),
                            "gsi reconcile"
                        ),
                        Err(err) => {
                            tracing::warn!(table = table_name::<E>(), error = %err.report(), "gsi reconcile failed")
                        }
                    }
                    ControlFlow::Continue(())
                }
            },
        )
    }
}
