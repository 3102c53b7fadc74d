//! Folds: a new row derived from a root row of the old entity and the rows
//! of other entities of its group that belong to it, its *parts* (PayPal's
//! denormalisation: an address folded into the user row, order lines into
//! the order).
//!
//! A part row belongs to the root whose primary key its *link* column holds,
//! under the same shard key, so a root and its parts are always on one
//! shard and one transaction re-derives the new row:
//!
//! - a write of the root folds it with its parts, read in the transaction;
//! - a write of a part re-folds its root after the write (an update that
//!   moves the part to another root, and a delete, first re-fold the root it
//!   leaves, without it);
//! - backfill and verify fold chunk by chunk (one read per part entity for
//!   the whole chunk);
//! - from `new_only` on, a write of a part (or an update of the root) is
//!   applied to the folded row: split with `to_old_parts`, changed,
//!   folded again.
//!
//! **Concurrency.** Two transactions that change parts of one root must not
//! both fold from what they saw before the other committed. Every re-fold
//! reads the root row under the row lock first (`FOR UPDATE`; SQLite
//! transactions are serial), so they take turns, and the later one reads
//! the parts after the earlier commit: on PostgreSQL because each statement
//! of a `READ COMMITTED` transaction sees what committed before it, on
//! MySQL/MariaDB because the parts are read with a locking read (which reads
//! the latest rows, not the transaction's snapshot). On MySQL a part write
//! also locks its root *before* it writes the part, so no transaction holds
//! a part's row lock while it waits for the root: the root's own writes,
//! which read the parts with that locking read, could otherwise wait for it
//! in turn.

use crate::entity::{ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::keyset::{pk_condition, tuple_text};
use crate::read::KeyOf;
use crate::rollout::parts::Parts;
use crate::rollout::{CacheUpdate, DualCtx, Shared, cache_key};
use futures::future::BoxFuture;
use sea_orm::{ConnectionTrait, DatabaseExecutor, DbErr, QueryFilter, QuerySelect, Value};
use std::sync::Arc;

impl<Old, New> Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    /// Whether the new row folds parts (not a one-to-one rollout).
    pub(crate) fn folds(&self) -> bool {
        !self.parts.is_empty()
    }

    /// The new model of a root without reading its parts: a one-to-one
    /// rollout's conversion.
    pub(crate) fn convert_alone(&self, root: &Old::Model) -> New::Model {
        (self.to_new)(root, &Parts::default())
    }

    /// Reads the parts of `roots` into `parts` (aligned), one read per part
    /// entity and per [`FOLD_BATCH`] roots; an error names the part's table.
    pub(super) async fn load_parts(
        &self,
        db: &DatabaseExecutor<'_>,
        roots: &[Old::Model],
        parts: &mut [Parts],
        lock: bool,
    ) -> std::result::Result<(), (&'static str, DbErr)> {
        for part in &self.parts {
            for (roots, parts) in roots.chunks(FOLD_BATCH).zip(parts.chunks_mut(FOLD_BATCH)) {
                part.load(db, roots, parts, lock)
                    .await
                    .map_err(|e| (part.table(), e))?;
            }
        }
        Ok(())
    }

    /// The new models of `roots`, each folded with its parts read on `db`
    /// (none read for a one-to-one rollout).
    pub(crate) async fn fold_rows(
        &self,
        db: &DatabaseExecutor<'_>,
        roots: &[Old::Model],
        lock: bool,
    ) -> std::result::Result<Vec<New::Model>, (&'static str, DbErr)> {
        if !self.folds() {
            return Ok(roots.iter().map(|r| self.convert_alone(r)).collect());
        }
        let mut parts: Vec<Parts> = roots.iter().map(|_| Parts::default()).collect();
        self.load_parts(db, roots, &mut parts, lock).await?;
        Ok(roots
            .iter()
            .zip(&parts)
            .map(|(root, parts)| (self.to_new)(root, parts))
            .collect())
    }

    /// The error of a part read in a write's transaction.
    pub(super) fn part_err(
        &self,
        shard: &str,
        (table, source): (&'static str, DbErr),
    ) -> ShardError {
        self.db_err(
            shard,
            format!("select {table} (to fold into {})", table_name::<New>()),
            source,
        )
    }

    /// [`fold_rows`](Self::fold_rows) of one root, in a write's transaction.
    pub(super) async fn fold_in(&self, ctx: &DualCtx<'_>, root: &Old::Model) -> Result<New::Model> {
        if !self.folds() {
            return Ok(self.convert_alone(root));
        }
        let db = DatabaseExecutor::Transaction(ctx.txn);
        let mut rows = self
            .fold_rows(&db, std::slice::from_ref(root), true)
            .await
            .map_err(|e| self.part_err(ctx.shard, e))?;
        Ok(rows.pop().expect("one root, one row"))
    }

    /// The root row `pk` under `key`, read under its row lock in the
    /// write's transaction.
    pub(super) async fn lock_root(
        &self,
        ctx: &DualCtx<'_>,
        key: &KeyOf<Old>,
        pk: &Value,
    ) -> Result<Option<Old::Model>> {
        let backend = ctx.txn.get_database_backend();
        let mut select = Old::find()
            .filter(crate::read::key_condition::<Old>(
                std::slice::from_ref(key),
                backend,
            ))
            .filter(pk_condition::<Old>(std::slice::from_ref(pk)));
        if backend != sea_orm::DbBackend::Sqlite {
            select = select.lock_exclusive();
        }
        select
            .one(ctx.txn)
            .await
            .map_err(|e| self.db_err(ctx.shard, format!("lock {}", table_name::<Old>()), e))
    }

    /// Derives the new row of root `pk` again, in the write's transaction:
    /// the root read under its row lock, its parts as they now are, folded;
    /// written when `write` (`dual_write`, `read_new`), and the caches filled
    /// after the commit. A part whose root does not exist folds into nothing.
    pub(super) async fn refold(
        self: &Arc<Self>,
        ctx: &DualCtx<'_>,
        key: &KeyOf<Old>,
        pk: &Value,
        write: bool,
    ) -> Result<CacheUpdate> {
        let Some(root) = self.lock_root(ctx, key, pk).await? else {
            let ck = cache_key(
                &key.to_directory_text(),
                &tuple_text(std::slice::from_ref(pk)),
            );
            return Ok(self.invalidate_both(ck));
        };
        let new = self.fold_in(ctx, &root).await?;
        if write {
            self.write_new(ctx, &root, new.clone(), false).await?;
        }
        Ok(self.fill_both(root, new))
    }
}

/// Roots per part read (each binds its primary key, and its shard key when
/// it differs from the others'): far below the 65,535 bind parameters of
/// PostgreSQL and MySQL whatever the chunk size of a backfill or verify.
const FOLD_BATCH: usize = 1_000;

impl<Old, New> crate::verify::FoldRows<Old::Model, New::Model> for Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
{
    fn fold_rows<'a>(
        &'a self,
        db: &'a DatabaseExecutor<'a>,
        rows: &'a [Old::Model],
    ) -> BoxFuture<'a, std::result::Result<Vec<New::Model>, (&'static str, DbErr)>> {
        // Locking only matters where verify repairs inside a transaction:
        // outside one, MySQL's locking read just reads the latest rows.
        Box::pin(Shared::fold_rows(self, db, rows, true))
    }
}
