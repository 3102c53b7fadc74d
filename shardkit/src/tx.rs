//! [`ShardTx<G>`]: a transaction pinned to one entity group and one shard key.
//!
//! The key, not the shard, is what a transaction is for: two keys that share a
//! shard today may not after a rebalance, so a write whose row carries another
//! key is refused even when it would land on the same database. Rows of other
//! groups are refused at compile time (the [`InGroup`] bound).

use crate::entity::{EntityGroup, InGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::read::TxFind;
use crate::rollout::{OldWrites, Phase, WriteCtx};
use crate::topology::Target;
use sea_orm::ModelTrait;
use sea_orm::{
    ActiveModelBehavior, ActiveModelTrait, ColumnTrait, DatabaseTransaction, DbErr, EntityTrait,
    IntoActiveModel, QueryFilter,
};
use std::sync::{Arc, Mutex};

/// A transaction on the shard of one key of group `G`.
///
/// Open it with [`Cluster::begin`](crate::Cluster::begin). Writes take SeaORM
/// ActiveModels of `G`'s entities. Before any SQL runs, each write's shard key
/// is checked: a missing key is [`ShardError::MissingShardKey`], a different
/// key is [`ShardError::CrossShardWrite`]. Either refusal makes the
/// transaction rollback-only: later writes and [`commit`](Self::commit) return
/// [`ShardError::RollbackOnly`] and nothing is written. Dropping it without
/// committing rolls it back.
pub struct ShardTx<G: EntityGroup> {
    txn: DatabaseTransaction,
    cluster: crate::Cluster,
    /// Index rows to remove once the primary transaction has committed.
    removals: Mutex<Vec<crate::gsi::Removal>>,
    /// Rollout cache fills and invalidations, applied once committed.
    after_commit: Mutex<Vec<crate::rollout::AfterCommit>>,
    key: G::Key,
    shard: String,
    target: Target,
    poisoned: std::sync::OnceLock<String>,
    span: tracing::Span,
    /// The cluster's SQLite write slot, held until the transaction ends
    /// (see [`Cluster::begin`](crate::Cluster::begin)). Declared after `txn`
    /// so the transaction rolls back before the slot is released.
    _writer: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<G: EntityGroup> std::fmt::Debug for ShardTx<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardTx")
            .field("group", &G::NAME)
            .field("shard", &self.shard)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl<G: EntityGroup> ShardTx<G> {
    pub(crate) fn new(
        txn: DatabaseTransaction,
        cluster: crate::Cluster,
        key: G::Key,
        shard: String,
        target: Target,
        span: tracing::Span,
    ) -> Self {
        ShardTx {
            txn,
            cluster,
            removals: Mutex::new(Vec::new()),
            after_commit: Mutex::new(Vec::new()),
            key,
            shard,
            target,
            poisoned: std::sync::OnceLock::new(),
            span,
            _writer: None,
        }
    }

    /// Keeps `writer` (the cluster's SQLite write slot) until it ends.
    pub(crate) fn holding(mut self, writer: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        self._writer = writer;
        self
    }

    /// The key the transaction is pinned to.
    pub fn key(&self) -> &G::Key {
        &self.key
    }

    /// The name of the shard it runs on.
    pub fn shard(&self) -> &str {
        &self.shard
    }

    /// Where its key was routed.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The transaction's own connection, for statements shardkit cannot check
    /// (shard-wide aggregates, locks, per-shard counters). What runs through
    /// it is not limited to the transaction's key: keep writes of rows on the
    /// typed methods.
    pub fn unchecked_connection(&self) -> &DatabaseTransaction {
        &self.txn
    }

    /// Whether an earlier refusal made it rollback-only.
    pub fn is_rollback_only(&self) -> bool {
        self.poisoned.get().is_some()
    }

    fn poison_reason(&self) -> Option<String> {
        self.poisoned.get().cloned()
    }

    fn poison(&self, err: ShardError) -> ShardError {
        // The first refusal is the reason; later ones keep it.
        let _ = self.poisoned.set(err.to_string());
        err
    }

    fn ensure_open(&self) -> Result<()> {
        match self.poisoned.get() {
            Some(reason) => Err(ShardError::RollbackOnly {
                group: G::NAME,
                shard: self.shard.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses a row whose shard key is missing or not the transaction's.
    fn check<E: InGroup<G>>(&self, model: &E::ActiveModel) -> Result<()> {
        self.ensure_open()?;
        match E::group_key_of(model) {
            None => Err(self.poison(ShardError::MissingShardKey {
                entity: table_name::<E>(),
                column: E::SHARD_KEY_FIELD,
            })),
            Some(found) if found != self.key => Err(self.poison(ShardError::CrossShardWrite {
                entity: table_name::<E>(),
                column: E::SHARD_KEY_FIELD,
                expected: format!("{:?}", self.key),
                found: format!("{found:?}"),
            })),
            Some(_) => Ok(()),
        }
    }

    /// A read of the row `model` names (primary key) within the key.
    fn row_select<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
        op: &str,
    ) -> Result<sea_orm::Select<E>> {
        let mut select = E::find().filter(self.key_condition::<E>());
        for key in <E::PrimaryKey as sea_orm::Iterable>::iter() {
            let column = sea_orm::PrimaryKeyToColumn::into_column(key);
            match model.get(column) {
                sea_orm::ActiveValue::Set(v) | sea_orm::ActiveValue::Unchanged(v) => {
                    select = select.filter(column.eq(v));
                }
                sea_orm::ActiveValue::NotSet => {
                    return Err(self.write_err::<E>(op, DbErr::PrimaryKeyNotSet { ctx: "ShardTx" }));
                }
            }
        }
        Ok(select)
    }

    /// Writes the index rows of `model`'s indexed values, each committed on
    /// its own before the primary write. With `current` (an update), only
    /// changed values are written, and the old rows are queued for removal
    /// after the commit.
    async fn index_first<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
        current: Option<&E::Model>,
    ) -> Result<()> {
        if E::GLOBAL_INDEXES.is_empty() {
            return Ok(());
        }
        let key = self.key.to_directory_text();
        let owner = crate::gsi::owner_pk(model);
        let gsi = self.cluster.gsi();
        let mut changed = Vec::new();
        for (column, unique) in E::GLOBAL_INDEXES {
            let value = match (model.get(*column), current) {
                (sea_orm::ActiveValue::Set(v), _) | (sea_orm::ActiveValue::Unchanged(v), None) => v,
                _ => continue,
            };
            if let Some(current) = current {
                let old = current.get(*column);
                if crate::gsi::value_text(&old) == crate::gsi::value_text(&value) {
                    continue;
                }
                changed.push(*column);
            }
            let index = crate::gsi::IndexDef::of::<E>(*column, *unique);
            gsi.write_entry_from::<E>(
                &index,
                &value,
                &key,
                &owner,
                Some((self.target.shard, &self.txn)),
            )
            .await
            .map_err(|e| self.poison_if_aborted(e))?;
        }
        fail::fail_point!("shardkit::gsi::after_index_write", |_| Err(self
            .write_err::<E>(
                "insert",
                DbErr::Custom("failpoint shardkit::gsi::after_index_write".into())
            )));
        if let Some(current) = current {
            self.queue_removals::<E>(current, &changed).await?;
        }
        Ok(())
    }

    /// A database that aborted the transaction (a deadlock, a serialization
    /// failure: [`Retry::Transaction`](crate::error::Retry::Transaction))
    /// has rolled back everything it did, on MySQL/MariaDB at once: later
    /// statements would run outside it. It becomes rollback-only, and the
    /// error (which says to run the transaction again) goes to the caller.
    fn poison_if_aborted(&self, err: ShardError) -> ShardError {
        if err.retry() == crate::error::Retry::Transaction {
            self.poison(err)
        } else {
            err
        }
    }

    /// Queues removal of `row`'s index rows for `columns`, after the commit,
    /// each as the version it has now (see [`crate::gsi`]'s removals).
    async fn queue_removals<E: InGroup<G>>(
        &self,
        row: &E::Model,
        columns: &[E::Column],
    ) -> Result<()> {
        let key = self.key.to_directory_text();
        let owner = crate::gsi::model_pk::<E>(row);
        let gsi = self.cluster.gsi();
        for (column, unique) in E::GLOBAL_INDEXES {
            if !columns
                .iter()
                .any(|c| sea_orm::IdenStatic::as_str(c) == sea_orm::IdenStatic::as_str(column))
            {
                continue;
            }
            let index = crate::gsi::IndexDef::of::<E>(*column, *unique);
            let removal = gsi
                .removal::<E>(
                    &index,
                    &row.get(*column),
                    &key,
                    &owner,
                    Some((self.target.shard, &self.txn)),
                )
                .await?;
            if let Some(removal) = removal {
                self.removals
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(removal);
            }
        }
        Ok(())
    }

    /// The current row `model` names, read under the row lock the write will
    /// take (`FOR UPDATE` on PostgreSQL and MySQL; SQLite's write lock is
    /// held from `BEGIN IMMEDIATE`): a concurrent write of the same row
    /// waits for this transaction instead of deciding its index rows from a
    /// value this one is about to change.
    async fn current_row<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
        op: &str,
    ) -> Result<Option<E::Model>> {
        let mut select = self.row_select::<E>(model, op)?;
        if sea_orm::ConnectionTrait::get_database_backend(&self.txn) != sea_orm::DbBackend::Sqlite {
            select = sea_orm::QuerySelect::lock_exclusive(select);
        }
        select
            .one(&self.txn)
            .await
            .map_err(|e| self.write_err::<E>(op, e))
    }

    /// The transaction's key as a predicate on `E` (see [`crate::read`]).
    fn key_condition<E: InGroup<G>>(&self) -> sea_orm::Condition {
        crate::read::key_condition::<E>(
            &[E::group_key_as_entity_key(&self.key)],
            sea_orm::ConnectionTrait::get_database_backend(&self.txn),
        )
    }

    /// The rollout registered for `E`, if any (see [`crate::rollout`]).
    fn rollout_of<E: EntityTrait>(&self) -> Option<Arc<dyn OldWrites>> {
        self.cluster.rollout_writes(std::any::TypeId::of::<E>())
    }

    fn rollout_ctx(&self) -> WriteCtx<'_> {
        WriteCtx {
            cluster: &self.cluster,
            txn: &self.txn,
            shard: &self.shard,
            shard_id: self.target.shard,
        }
    }

    fn defer(&self, after: Option<crate::rollout::AfterCommit>) {
        if let Some(after) = after {
            self.after_commit
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(after);
        }
    }

    /// Lets the rollout of the written old row dual-write it; a failure
    /// makes the transaction rollback-only (neither table commits).
    async fn rollout_after_write<E: EntityTrait>(
        &self,
        rollout: Option<&Arc<dyn OldWrites>>,
        row: &E::Model,
    ) -> Result<()> {
        if let Some(rollout) = rollout {
            let after = rollout
                .after_write(self.rollout_ctx(), Box::new(row.clone()))
                .await
                .map_err(|e| self.poison(e))?;
            self.defer(after);
        }
        Ok(())
    }

    /// Lets the rollout of a deleted old row delete the new row (when it
    /// dual-writes) and drop both cache entries after the commit; returns
    /// the new rows deleted.
    async fn rollout_after_delete<A: Clone + Send + 'static>(
        &self,
        rollout: &Arc<dyn OldWrites>,
        model: &A,
    ) -> Result<u64> {
        let (deleted, after) = rollout
            .after_delete(self.rollout_ctx(), Box::new(model.clone()))
            .await
            .map_err(|e| self.poison(e))?;
        self.defer(after);
        Ok(deleted)
    }

    /// In `new_only` and later, a write of the old entity goes to the new
    /// table only; returns the old model as written.
    async fn rollout_new_only<E: EntityTrait>(
        &self,
        rollout: &Arc<dyn OldWrites>,
        model: E::ActiveModel,
        update: bool,
    ) -> Result<E::Model>
    where
        E::ActiveModel: Send + 'static,
    {
        let (row, after) = rollout
            .write_new_only(self.rollout_ctx(), Box::new(model), update)
            .await
            .map_err(|e| self.poison(e))?;
        self.defer(Some(after));
        row.downcast::<E::Model>().map(|b| *b).map_err(|_| {
            self.poison(ShardError::Rollout {
                rollout: rollout.name().to_owned(),
                phase: rollout.phase(),
                reason: "internal: the rollout returned another model type".into(),
            })
        })
    }

    fn write_err<E: EntityTrait>(&self, op: &str, source: DbErr) -> ShardError {
        ShardError::Db {
            group: G::NAME,
            shard: self.shard.clone(),
            operation: format!("{op} {}", table_name::<E>()),
            source,
        }
    }

    fn write_span<E: EntityTrait>(&self, op: &'static str) -> tracing::Span {
        tracing::info_span!(parent: &self.span, "shardkit.write", op = op, table = table_name::<E>())
    }

    /// Inserts a row of the transaction's key; returns it as stored.
    ///
    /// The shard key is checked before anything runs, and again after
    /// `ActiveModelBehavior::before_save`, so a hook cannot move the row. An
    /// unset primary key with `#[shardkit(id = "...")]` is filled first.
    pub async fn insert<A>(&self, mut model: A) -> Result<<A::Entity as EntityTrait>::Model>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        self.check::<A::Entity>(&model)?;
        if let Some((column, strategy)) = <A::Entity as ShardedEntity>::ID
            && model.get(column).is_not_set()
        {
            let id = self.cluster.ids().generate(strategy).await?;
            model
                .try_set(column, id)
                .map_err(|e| self.write_err::<A::Entity>("insert", e))?;
        }
        let span = self.write_span::<A::Entity>("insert");
        crate::trace::in_span(span, async {
            let model = A::before_save(model, &self.txn, true)
                .await
                .map_err(|e| self.write_err::<A::Entity>("insert", e))?;
            self.check::<A::Entity>(&model)?;
            let rollout = self.rollout_of::<A::Entity>();
            if let Some(r) = rollout.as_ref().filter(|r| r.phase() >= Phase::NewOnly) {
                let row = self.rollout_new_only::<A::Entity>(r, model, false).await?;
                return A::after_save(row, &self.txn, true)
                    .await
                    .map_err(|e| self.write_err::<A::Entity>("insert", e));
            }
            // Index rows commit before the primary row is even written.
            self.index_first::<A::Entity>(&model, None).await?;
            let row = <A::Entity as EntityTrait>::insert(model)
                .exec_with_returning(&self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>("insert", e))?;
            self.rollout_after_write::<A::Entity>(rollout.as_ref(), &row)
                .await?;
            A::after_save(row, &self.txn, true)
                .await
                .map_err(|e| self.write_err::<A::Entity>("insert", e))
        })
        .await
    }

    /// Updates a row of the transaction's key by primary key; returns it as
    /// stored. The `UPDATE` also matches the shard key, so a row of another key
    /// with the same primary key is never touched (SeaORM's
    /// `RecordNotUpdated` is returned instead).
    pub async fn update<A>(&self, model: A) -> Result<<A::Entity as EntityTrait>::Model>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        self.check::<A::Entity>(&model)?;
        let span = self.write_span::<A::Entity>("update");
        crate::trace::in_span(span, async {
            let model = A::before_save(model, &self.txn, false)
                .await
                .map_err(|e| self.write_err::<A::Entity>("update", e))?;
            self.check::<A::Entity>(&model)?;
            let rollout = self.rollout_of::<A::Entity>();
            if let Some(r) = rollout.as_ref().filter(|r| r.phase() >= Phase::NewOnly) {
                let row = self.rollout_new_only::<A::Entity>(r, model, true).await?;
                return A::after_save(row, &self.txn, false)
                    .await
                    .map_err(|e| self.write_err::<A::Entity>("update", e));
            }
            if !model.is_changed() {
                // Nothing to set: SeaORM would answer with a primary-key read
                // that ignores the shard key. Read within the key instead.
                let select = self.row_select::<A::Entity>(&model, "update")?;
                let row = select
                    .one(&self.txn)
                    .await
                    .map_err(|e| self.write_err::<A::Entity>("update", e))?
                    .ok_or_else(|| {
                        self.write_err::<A::Entity>("update", DbErr::RecordNotUpdated)
                    })?;
                return A::after_save(row, &self.txn, false)
                    .await
                    .map_err(|e| self.write_err::<A::Entity>("update", e));
            }
            if !<A::Entity as ShardedEntity>::GLOBAL_INDEXES.is_empty() {
                let current = self.current_row::<A::Entity>(&model, "update").await?;
                if let Some(current) = current {
                    self.index_first::<A::Entity>(&model, Some(&current))
                        .await?;
                }
            }
            let row = <A::Entity as EntityTrait>::update(model)
                .validate()
                .map_err(|e| self.write_err::<A::Entity>("update", e))?
                .filter(self.key_condition::<A::Entity>())
                .exec(&self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>("update", e))?;
            self.rollout_after_write::<A::Entity>(rollout.as_ref(), &row)
                .await?;
            A::after_save(row, &self.txn, false)
                .await
                .map_err(|e| self.write_err::<A::Entity>("update", e))
        })
        .await
    }

    /// Deletes a row of the transaction's key by primary key; returns the
    /// number of rows deleted (0 or 1). The `DELETE` also matches the shard key.
    pub async fn delete<A>(&self, model: A) -> Result<u64>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
    {
        self.check::<A::Entity>(&model)?;
        let span = self.write_span::<A::Entity>("delete");
        crate::trace::in_span(span, async {
            let model = A::before_delete(model, &self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>("delete", e))?;
            self.check::<A::Entity>(&model)?;
            let rollout = self.rollout_of::<A::Entity>();
            if let Some(r) = rollout.as_ref().filter(|r| r.phase() >= Phase::NewOnly) {
                let deleted = self.rollout_after_delete(r, &model).await?;
                A::after_delete(model, &self.txn)
                    .await
                    .map_err(|e| self.write_err::<A::Entity>("delete", e))?;
                return Ok(deleted);
            }
            let current = if <A::Entity as ShardedEntity>::GLOBAL_INDEXES.is_empty() {
                None
            } else {
                self.current_row::<A::Entity>(&model, "delete").await?
            };
            let res = <A::Entity as EntityTrait>::delete(model.clone())
                .validate()
                .map_err(|e| self.write_err::<A::Entity>("delete", e))?
                .filter(self.key_condition::<A::Entity>())
                .exec(&self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>("delete", e))?;
            if let Some(current) = current.filter(|_| res.rows_affected > 0) {
                // The primary row goes first; its index rows after it commits.
                let all: Vec<_> = <A::Entity as ShardedEntity>::GLOBAL_INDEXES
                    .iter()
                    .map(|(c, _)| *c)
                    .collect();
                self.queue_removals::<A::Entity>(&current, &all).await?;
            }
            if let Some(r) = &rollout {
                self.rollout_after_delete(r, &model).await?;
            }
            A::after_delete(model, &self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>("delete", e))?;
            Ok(res.rows_affected)
        })
        .await
    }

    /// Reads rows of the transaction's key, inside the transaction.
    pub fn find<E: InGroup<G>>(&self) -> TxFind<'_, E, DatabaseTransaction> {
        TxFind::new(
            &self.txn,
            &self.shard,
            &E::group_key_as_entity_key(&self.key),
        )
    }

    /// Commits. If a write was refused, rolls back instead and returns
    /// [`ShardError::RollbackOnly`].
    pub async fn commit(self) -> Result<()> {
        if let Some(reason) = self.poison_reason() {
            let ShardTx { txn, shard, .. } = self;
            txn.rollback().await.map_err(|source| ShardError::Db {
                group: G::NAME,
                shard: shard.clone(),
                operation: "rollback".to_owned(),
                source,
            })?;
            return Err(ShardError::RollbackOnly {
                group: G::NAME,
                shard,
                reason,
            });
        }
        let ShardTx {
            txn,
            shard,
            span,
            cluster,
            removals,
            after_commit,
            _writer: writer,
            ..
        } = self;
        crate::trace::in_span(span, txn.commit())
            .await
            .map_err(|source| ShardError::Db {
                group: G::NAME,
                shard,
                operation: "commit".to_owned(),
                source,
            })?;
        // The SQLite write lock is released; so is the cluster's slot.
        drop(writer);
        for after in after_commit.into_inner().unwrap_or_else(|p| p.into_inner()) {
            after();
        }
        // Old index rows go only now; a failure here leaves a dangling row,
        // which lookups ignore and reconciliation removes.
        let removals = removals.into_inner().unwrap_or_else(|p| p.into_inner());
        for removal in &removals {
            if let Err(err) = cluster.gsi().remove_entry(removal).await {
                tracing::warn!(index = %removal.index.table, error = %err, "index row left for reconciliation");
            }
        }
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<()> {
        let ShardTx { txn, shard, .. } = self;
        txn.rollback().await.map_err(|source| ShardError::Db {
            group: G::NAME,
            shard,
            operation: "rollback".to_owned(),
            source,
        })
    }
}
