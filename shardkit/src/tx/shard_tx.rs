//! A transaction pinned to one shard key ([`ShardTx`]).

use crate::boxed::boxed;
use crate::entity::{EntityGroup, InGroup, table_name};
use crate::error::{Result, ShardError};
use crate::exec::{Begun, Shards};
use crate::pipeline::{AfterCommit, Batch, Replaced, WriteCtx, WriteOp, WriteStage, Written};
use crate::read::TxFind;
use crate::topology::Target;
use futures::future::BoxFuture;
use sea_orm::{
    ActiveModelBehavior, ActiveModelTrait, ColumnTrait, DatabaseTransaction, DbErr, EntityTrait,
    IntoActiveModel, QueryFilter,
};
use std::sync::{Arc, Mutex};

/// A transaction on the shard of one key of group `G`, whose writes pass
/// through the write pipeline `P` (see [`crate::pipeline`]). Programs name
/// it [`shardkit::ShardTx<G>`](crate::ShardTx): `P` is the cluster's stages.
///
/// Open it with [`Cluster::begin`](crate::Cluster::begin). Writes take SeaORM
/// ActiveModels of `G`'s entities. Before any SQL runs, each write's shard key
/// is checked: a missing key is [`ShardError::MissingShardKey`], a different
/// key is [`ShardError::CrossShardWrite`]. Either refusal makes the
/// transaction rollback-only: later writes and [`commit`](Self::commit) return
/// [`ShardError::RollbackOnly`] and nothing is written. So does an error with
/// which the database ended the transaction (a deadlock, a serialization
/// failure), in a write or a read; later reads are then refused too
/// ([`Cluster::transaction`](crate::Cluster::transaction) runs its work again
/// then, whatever error the work made of it). Dropping it without
/// committing rolls it back.
pub struct ShardTx<G: EntityGroup, P> {
    pub(super) txn: DatabaseTransaction,
    shards: Shards,
    pub(super) stages: Arc<P>,
    /// Work the stages queued for after the commit, in order.
    after_commit: Mutex<Vec<AfterCommit>>,
    pub(super) key: G::Key,
    /// `key` as the text stages store, made when first needed.
    key_text: std::sync::OnceLock<String>,
    target: Target,
    poisoned: crate::read::Poison,
    /// Streams of this transaction still open (see [`TxFind::stream`]).
    streams: std::sync::atomic::AtomicUsize,
    /// What the features say of reads (a rollout's old entity from
    /// `read_new` on).
    guard: Option<Arc<dyn crate::read::ReadGuard>>,
    span: tracing::Span,
    /// The cluster's SQLite write slot, held until the transaction ends
    /// (see [`Cluster::begin`](crate::Cluster::begin)). Declared after `txn`
    /// so the transaction rolls back before the slot is released.
    _writer: Option<crate::exec::sqlite::WriterPermit>,
}

impl<G: EntityGroup, P> std::fmt::Debug for ShardTx<G, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardTx")
            .field("group", &G::NAME)
            .field("shard", &self.shards.shard_name(self.target.shard))
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl<G: EntityGroup, P: WriteStage> ShardTx<G, P> {
    pub(crate) fn new(
        begun: Begun,
        shards: Shards,
        stages: Arc<P>,
        guard: Option<Arc<dyn crate::read::ReadGuard>>,
        key: G::Key,
    ) -> Self {
        let Begun {
            txn,
            target,
            span,
            writer,
        } = begun;
        ShardTx {
            txn,
            shards,
            stages,
            after_commit: Mutex::new(Vec::new()),
            key_text: std::sync::OnceLock::new(),
            key,
            target,
            poisoned: crate::read::Poison::default(),
            streams: std::sync::atomic::AtomicUsize::new(0),
            guard,
            span,
            _writer: writer,
        }
    }

    /// The key the transaction is pinned to.
    pub fn key(&self) -> &G::Key {
        &self.key
    }

    /// The name of the shard it runs on.
    pub fn shard(&self) -> &str {
        self.shards.shard_name(self.target.shard)
    }

    /// The execution layer it runs on.
    pub(crate) fn shards(&self) -> &Shards {
        &self.shards
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

    /// Whether an earlier refusal, or a write or read the database aborted,
    /// made it rollback-only ([`ShardError::RollbackOnly`]).
    pub fn is_rollback_only(&self) -> bool {
        self.poisoned.reason().is_some()
    }

    /// Whether the database ended the transaction (a deadlock, a
    /// serialization failure met by one of its statements), whatever the
    /// program did with that error: a new attempt can succeed. Also set
    /// when such an error came from a statement a write stage sent for the
    /// transaction on a side connection (a global index's claim): the
    /// transaction is rollback-only then too, and a new attempt can succeed
    /// as well. Statements sent through
    /// [`unchecked_connection`](Self::unchecked_connection) do not set it.
    pub(crate) fn was_aborted(&self) -> bool {
        self.poisoned.aborted()
    }

    pub(crate) fn poison_reason(&self) -> Option<String> {
        self.poisoned.reason().cloned()
    }

    pub(crate) fn poison(&self, err: ShardError) -> ShardError {
        // The first refusal is the reason; later ones keep it.
        self.poisoned.set(&err);
        err
    }

    pub(crate) fn ensure_open(&self) -> Result<()> {
        crate::read::stream_open(&self.streams, G::NAME)?;
        match self.poisoned.reason() {
            Some(reason) => Err(ShardError::RollbackOnly {
                group: G::NAME,
                shard: self.shard().to_owned(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses a row whose shard key is missing or not the transaction's.
    fn check<E: InGroup<G>>(&self, model: &E::ActiveModel) -> Result<()> {
        self.ensure_open()?;
        match E::active_shard_key(model) {
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
        let mut select = E::find().filter(self.key_expr::<E>());
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
        if self.backend() != sea_orm::DbBackend::Sqlite {
            select = sea_orm::QuerySelect::lock_exclusive(select);
        }
        select
            .one(&self.txn)
            .await
            .map_err(|e| self.write_err::<E>(op, e))
    }

    /// A database that aborted the transaction (a deadlock, a serialization
    /// failure: [`Retry::Transaction`](crate::error::Retry::Transaction))
    /// has rolled back everything it did, on MySQL/MariaDB at once: later
    /// statements would run outside it. It becomes rollback-only, and the
    /// error (which says to run the transaction again) goes to the caller.
    pub(super) fn poison_if_aborted(&self, err: ShardError) -> ShardError {
        crate::read::poison_if_aborted(&self.poisoned, err)
    }

    /// The transaction's key as a predicate on `E` (see [`crate::read`]).
    pub(super) fn key_expr<E: InGroup<G>>(&self) -> sea_orm::sea_query::Expr {
        crate::read::key_expr::<E>(&self.key, self.backend())
    }

    pub(super) fn backend(&self) -> sea_orm::DbBackend {
        sea_orm::ConnectionTrait::get_database_backend(&self.txn)
    }

    pub(super) fn ctx(&self) -> WriteCtx<'_> {
        WriteCtx {
            shards: &self.shards,
            txn: &self.txn,
            shard: self.target.shard,
            shard_name: self.shard(),
            key: &self.key,
            key_text: &self.key_text,
            after_commit: &self.after_commit,
        }
    }

    /// A database error of a write of `E` (its statement, a SeaORM hook's,
    /// the row read under lock). One that aborted the transaction makes it
    /// rollback-only ([`poison_if_aborted`](Self::poison_if_aborted)): on
    /// MySQL/MariaDB the statements after it would run outside it.
    pub(super) fn write_err<E: EntityTrait>(&self, op: &str, source: DbErr) -> ShardError {
        self.poison_if_aborted(ShardError::db(
            crate::error::Origin::Group(G::NAME),
            self.shard().to_owned(),
            format!("{op} {}", table_name::<E>()),
            source,
        ))
    }

    fn write_span<E: EntityTrait>(&self, op: &'static str) -> tracing::Span {
        tracing::info_span!(parent: &self.span, "shardkit.write", op = op, table = table_name::<E>())
    }

    /// Inserts a row of the transaction's key; returns it as stored.
    ///
    /// The shard key is checked before anything runs, and again after
    /// `ActiveModelBehavior::before_save`, so a hook cannot move the row. An
    /// unset primary key with `#[shardkit(id = "...")]` is filled first.
    pub fn insert<A>(&self, model: A) -> BoxFuture<'_, Result<<A::Entity as EntityTrait>::Model>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        boxed(|| self.write::<A::Entity>(WriteOp::Insert, model))
    }

    /// Inserts rows of the transaction's key, in order; returns them as
    /// stored. Every row's shard key is checked before anything runs: one
    /// row of another key (or with none) refuses the whole batch with
    /// [`ShardError::CrossShardWrite`] (or
    /// [`ShardError::MissingShardKey`]), nothing is written and the
    /// transaction becomes rollback-only. Each row then takes the write
    /// pipeline like [`insert`](Self::insert) (ids, hooks, index rows,
    /// rollouts): one `INSERT` per row, inside this transaction. `models`
    /// is collected when `insert_many` is called, before the first `.await`.
    pub fn insert_many<A, I>(
        &self,
        models: I,
    ) -> BoxFuture<'_, Result<Vec<<A::Entity as EntityTrait>::Model>>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
        I: IntoIterator<Item = A>,
    {
        let models: Vec<A> = models.into_iter().collect();
        boxed(|| self.insert_rows::<A::Entity>(models))
    }

    /// Inserts a row of the transaction's key without reading it back:
    /// SeaORM's [`Insert::exec_without_returning`](sea_orm::Insert::exec_without_returning),
    /// one `INSERT` and nothing else (no `RETURNING`, and on MySQL/MariaDB
    /// no `SELECT` by primary key after it); returns the number of rows
    /// inserted. Like SeaORM's `Entity::insert(..).exec_without_returning`,
    /// it runs no `ActiveModelBehavior` hook. The shard key is checked and
    /// an unset id with `#[shardkit(id = "...")]` filled as for
    /// [`insert`](Self::insert); an entity whose writes a stage must see row
    /// by row (a global index, a registered rollout) takes the whole write
    /// pipeline instead, reading the row back as `insert` does.
    pub fn insert_without_returning<A>(&self, model: A) -> BoxFuture<'_, Result<u64>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        boxed(|| self.write_without_returning::<A::Entity>(WriteOp::Insert, model))
    }

    /// Updates a row of the transaction's key by primary key without
    /// reading it back: one `UPDATE` of the set columns matching the
    /// primary key and the shard key (SeaORM's `Entity::update_many()`
    /// with the row's values); returns the number of rows updated (0 when
    /// the key has no such row). No `ActiveModelBehavior` hook runs. An
    /// entity whose writes a stage must see row by row takes the whole
    /// pipeline, as [`update`](Self::update) does.
    pub fn update_without_returning<A>(&self, model: A) -> BoxFuture<'_, Result<u64>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        boxed(|| self.write_without_returning::<A::Entity>(WriteOp::Update, model))
    }

    async fn write_without_returning<E: InGroup<G>>(
        &self,
        op: WriteOp,
        mut model: E::ActiveModel,
    ) -> Result<u64>
    where
        E::ActiveModel: 'static,
    {
        let name = op.as_str();
        self.check::<E>(&model)?;
        let ctx = self.ctx();
        match self.stages.batch::<E>(&ctx, op) {
            Batch::Statement => {}
            // A stage has work per row (or refuses): the whole pipeline.
            // Boxed: the pipeline's state would otherwise sit in every
            // statement-path future (one allocation of kilobytes per write).
            Batch::PerRow | Batch::Refused(_) => {
                return Box::pin(self.write_staged::<E>(op, model)).await.map(|_| 1);
            }
        }
        self.stages.prepare::<E>(&ctx, op, &mut model).await?;
        self.check::<E>(&model)?;
        let span = self.write_span::<E>(name);
        // Built before the await: the future holds the statement's text, not
        // the sea-query statement (hundreds of bytes more in every boxed
        // write).
        let Some(statement) = self.statement_without_returning::<E>(op, model)? else {
            // SeaORM's `exec` of an update that sets nothing.
            return Ok(0);
        };
        crate::trace::in_span(
            span,
            crate::exec::statements::rows_affected(&self.txn, statement),
        )
        .await
        .map_err(|e| self.write_err::<E>(name, e))
    }

    /// The one statement of [`write_without_returning`](Self::write_without_returning):
    /// the insert, or the update of the set columns matching the primary key
    /// and the shard key; `None` for an update that sets nothing.
    fn statement_without_returning<E: InGroup<G>>(
        &self,
        op: WriteOp,
        model: E::ActiveModel,
    ) -> Result<Option<sea_orm::Statement>> {
        let backend = self.backend();
        if op == WriteOp::Insert {
            let insert = sea_orm::QueryTrait::into_query(E::insert(model));
            return Ok(Some(backend.build(&insert)));
        }
        self.update_statement::<E>(&model, op.as_str(), false, || {
            DbErr::Custom("an update without its primary key set".to_owned())
        })
    }

    /// The `UPDATE` of `model`'s row as SeaORM's `Update::one` builds it
    /// (its set columns but the primary key's, matching its primary key), in
    /// the key (see [`crate::read::keyed_statement`]), with every column
    /// returned when `returning`; `None` when it sets no column.
    fn update_statement<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
        name: &str,
        returning: bool,
        missing_pk: impl FnOnce() -> DbErr,
    ) -> Result<Option<sea_orm::Statement>> {
        use sea_orm::{ActiveValue, Iterable, PrimaryKeyToColumn};
        let pk = self.pk_condition::<E>(model, name, missing_pk)?;
        let mut update = sea_orm::QueryTrait::into_query(E::update_many());
        for column in <E::Column as Iterable>::iter() {
            if <E::PrimaryKey as PrimaryKeyToColumn>::from_column(column).is_some() {
                continue;
            }
            if let ActiveValue::Set(value) = model.get(column) {
                update.value(column, column.save_as(sea_orm::sea_query::Expr::val(value)));
            }
        }
        if update.get_values().is_empty() {
            return Ok(None);
        }
        let backend = self.backend();
        let returning = match returning {
            true => crate::exec::statements::returning_exprs::<E>(backend),
            false => Vec::new(),
        };
        Ok(Some(crate::read::keyed_statement::<E, _>(
            &update,
            &self.key,
            backend,
            Some(pk),
            &returning,
        )))
    }

    /// `model`'s primary key as the condition that selects its row; `missing_pk`'s
    /// error (SeaORM's for the same write) when a column of it is not set.
    fn pk_condition<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
        name: &str,
        missing_pk: impl FnOnce() -> DbErr,
    ) -> Result<sea_orm::Condition> {
        let pk = <E::PrimaryKey as sea_orm::Iterable>::iter()
            .map(|c| {
                model
                    .get(sea_orm::PrimaryKeyToColumn::into_column(c))
                    .into_value()
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.write_err::<E>(name, missing_pk()))?;
        Ok(crate::exec::keyset::pk_condition::<E>(&pk))
    }

    async fn insert_rows<E: InGroup<G>>(&self, models: Vec<E::ActiveModel>) -> Result<Vec<E::Model>>
    where
        E::ActiveModel: 'static,
    {
        for model in &models {
            self.check::<E>(model)?;
        }
        let mut rows = Vec::with_capacity(models.len());
        for model in models {
            rows.push(self.write::<E>(WriteOp::Insert, model).await?);
        }
        Ok(rows)
    }

    /// Updates a row of the transaction's key by primary key; returns it as
    /// stored. The `UPDATE` also matches the shard key, so a row of another key
    /// with the same primary key is never touched nor returned (SeaORM's
    /// `RecordNotUpdated` is returned instead); so does the read of an update
    /// that sets nothing.
    pub fn update<A>(&self, model: A) -> BoxFuture<'_, Result<<A::Entity as EntityTrait>::Model>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        boxed(|| self.write::<A::Entity>(WriteOp::Update, model))
    }

    /// An insert or an update, through the write pipeline (see
    /// [`crate::pipeline`] for the steps).
    ///
    /// When no stage has work for a row of `E` (no global index, no
    /// rollout: the stages' [`batch`](WriteStage::batch) answer is one
    /// statement), the stage steps that would do nothing are skipped, and
    /// only the ids, SeaORM's hooks with the key's checks around them, and
    /// the write itself run. Otherwise the whole pipeline runs, boxed where
    /// taken, so the common write's future does not carry the stages' state.
    pub(crate) async fn write<E: InGroup<G>>(
        &self,
        op: WriteOp,
        mut model: E::ActiveModel,
    ) -> Result<E::Model>
    where
        E::ActiveModel: 'static,
    {
        let name = op.as_str();
        self.check::<E>(&model)?;
        let ctx = self.ctx();
        if self.stages.batch::<E>(&ctx, op) != Batch::Statement {
            return Box::pin(self.write_staged::<E>(op, model)).await;
        }
        self.stages.prepare::<E>(&ctx, op, &mut model).await?;
        let backend = self.backend();
        crate::trace::in_span(self.write_span::<E>(name), async {
            let insert = op == WriteOp::Insert;
            let model = self.before_save::<E>(model, insert, name).await?;
            // SeaORM's `exec_with_returning` and `exec`, with the statement
            // built before the await where the backend has `RETURNING`: the
            // future then holds SeaORM's boxed query future, not SeaORM's
            // chain around the statement and the model (4.7 KB in every
            // boxed write, past the allocator's cached sizes). An update's
            // statement is `update_statement`'s, in the key. Without
            // `RETURNING` (MySQL/MariaDB unless SeaORM's
            // `mariadb-use-returning` is on, SQLite unless
            // `sqlite-use-returning-for-3_35` is), an insert is SeaORM's own
            // path and an update its statement and then a read, boxed.
            // Each is made in a block of its own, and the model is moved in
            // every branch, so neither is kept across the await.
            use crate::exec::statements::{first_model, returning_all};
            use futures::future::Either;
            let returning = sea_orm::ConnectionTrait::support_returning(&self.txn);
            let write = if insert {
                let mut statement = E::insert(model);
                if returning {
                    let query = sea_orm::QueryTrait::query(&mut statement);
                    query.returning(returning_all::<E>(backend));
                    Either::Left(first_model::<E, _>(&self.txn, backend.build(&*query)))
                } else {
                    Either::Right(Box::pin(async move {
                        statement.exec_with_returning(&self.txn).await.map(Some)
                    }) as BoxFuture<'_, _>)
                }
            } else if !model.is_changed() {
                // Nothing to set: SeaORM would answer with a primary-key
                // read that ignores the shard key. Read within the key.
                let select = self.row_select::<E>(&model, name)?;
                drop(model);
                Either::Left(first_model::<E, _>(
                    &self.txn,
                    crate::exec::statements::one_statement(select, backend),
                ))
            } else {
                // MariaDB has no `RETURNING` on `UPDATE`, and sea-query writes
                // none for MySQL/MariaDB, even with SeaORM's
                // `mariadb-use-returning`: the update, then the read.
                let returning = returning && backend != sea_orm::DbBackend::MySql;
                let statement = self.update_statement::<E>(&model, name, returning, || {
                    DbErr::PrimaryKeyNotSet { ctx: "UpdateOne" }
                })?;
                match statement {
                    Some(statement) if returning => {
                        drop(model);
                        Either::Left(first_model::<E, _>(&self.txn, statement))
                    }
                    // Without `RETURNING`, SeaORM's way (the update, then a
                    // read of the row when it matched), both in the key:
                    // SeaORM's read is by primary key alone.
                    Some(statement) => {
                        let select = self.row_select::<E>(&model, name)?;
                        drop(model);
                        let read = crate::exec::statements::one_statement(select, backend);
                        let txn = &self.txn;
                        Either::Right(Box::pin(async move {
                            match crate::exec::statements::rows_affected(txn, statement).await? {
                                0 => Ok(None),
                                _ => first_model::<E, _>(txn, read).await,
                            }
                        }) as BoxFuture<'_, _>)
                    }
                    // It sets no column (only the primary key's): SeaORM would
                    // answer with a primary-key read that ignores the shard
                    // key, as above.
                    None => {
                        let select = self.row_select::<E>(&model, name)?;
                        drop(model);
                        Either::Left(first_model::<E, _>(
                            &self.txn,
                            crate::exec::statements::one_statement(select, backend),
                        ))
                    }
                }
            };
            let row = write
                .await
                .and_then(|row| {
                    row.ok_or_else(|| match insert {
                        true => DbErr::RecordNotFound("Failed to find inserted item".to_owned()),
                        false => DbErr::RecordNotUpdated,
                    })
                })
                .map_err(|e| self.write_err::<E>(name, e))?;
            <E::ActiveModel as ActiveModelBehavior>::after_save(row, &self.txn, insert)
                .await
                .map_err(|e| self.write_err::<E>(name, e))
        })
        .await
    }

    /// SeaORM's `before_save`, then the key's check again, so that a hook
    /// cannot move the row to another key.
    async fn before_save<E: InGroup<G>>(
        &self,
        model: E::ActiveModel,
        insert: bool,
        name: &str,
    ) -> Result<E::ActiveModel> {
        let model = <E::ActiveModel as ActiveModelBehavior>::before_save(model, &self.txn, insert)
            .await
            .map_err(|e| self.write_err::<E>(name, e))?;
        self.check::<E>(&model)?;
        Ok(model)
    }

    /// SeaORM's `before_delete`, then the key's check again, so that a hook
    /// cannot move the row to another key.
    async fn before_delete<A>(&self, model: A, name: &str) -> Result<A>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
    {
        let model = A::before_delete(model, &self.txn)
            .await
            .map_err(|e| self.write_err::<A::Entity>(name, e))?;
        self.check::<A::Entity>(&model)?;
        Ok(model)
    }

    /// [`write`](Self::write) with every stage of the pipeline.
    pub(super) async fn write_staged<E: InGroup<G>>(
        &self,
        op: WriteOp,
        mut model: E::ActiveModel,
    ) -> Result<E::Model>
    where
        E::ActiveModel: 'static,
    {
        let name = op.as_str();
        self.check::<E>(&model)?;
        let ctx = self.ctx();
        self.stages.prepare::<E>(&ctx, op, &mut model).await?;
        crate::trace::in_span(self.write_span::<E>(name), async {
            let insert = op == WriteOp::Insert;
            let model = self.before_save::<E>(model, insert, name).await?;
            let row = match self
                .stages
                .replace::<E>(&ctx, op, &model)
                .await
                .map_err(|e| self.poison(e))?
            {
                Some(Replaced::Saved(row)) => row,
                Some(Replaced::Deleted(_)) => {
                    return Err(self.poison(ShardError::internal(format!(
                        "a write stage answered a save of `{}` with a delete",
                        table_name::<E>()
                    ))));
                }
                None if insert => {
                    self.stages
                        .before_write::<E>(&ctx, op, &model, None)
                        .await
                        .map_err(|e| self.poison_if_aborted(e))?;
                    let row = E::insert(model)
                        .exec_with_returning(&self.txn)
                        .await
                        .map_err(|e| self.write_err::<E>(name, e))?;
                    let written = Written::Saved {
                        row: &row,
                        current: None,
                    };
                    self.stages
                        .after_write::<E>(&ctx, op, written)
                        .await
                        .map_err(|e| self.poison(e))?;
                    row
                }
                None if !sets_a_column::<E>(&model) => {
                    // Nothing to set (or only the primary key): SeaORM would
                    // answer with a primary-key read that ignores the shard
                    // key. Read within the key.
                    self.row_select::<E>(&model, name)?
                        .one(&self.txn)
                        .await
                        .map_err(|e| self.write_err::<E>(name, e))?
                        .ok_or_else(|| self.write_err::<E>(name, DbErr::RecordNotUpdated))?
                }
                None => {
                    let current = if self.stages.needs_current::<E>(op) {
                        self.current_row::<E>(&model, name).await?
                    } else {
                        None
                    };
                    self.stages
                        .before_write::<E>(&ctx, op, &model, current.as_ref())
                        .await
                        .map_err(|e| self.poison_if_aborted(e))?;
                    let update = E::update(model)
                        .validate()
                        .map_err(|e| self.write_err::<E>(name, e))?
                        .filter(self.key_expr::<E>());
                    let row = update
                        .exec(&self.txn)
                        .await
                        .map_err(|e| self.write_err::<E>(name, e))?;
                    let written = Written::Saved {
                        row: &row,
                        current: current.as_ref(),
                    };
                    self.stages
                        .after_write::<E>(&ctx, op, written)
                        .await
                        .map_err(|e| self.poison(e))?;
                    row
                }
            };
            <E::ActiveModel as ActiveModelBehavior>::after_save(row, &self.txn, insert)
                .await
                .map_err(|e| self.write_err::<E>(name, e))
        })
        .await
    }

    /// Deletes a row of the transaction's key by primary key; returns the
    /// number of rows deleted (0 or 1). The `DELETE` also matches the shard key.
    pub fn delete<A>(&self, model: A) -> BoxFuture<'_, Result<u64>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
    {
        boxed(|| self.delete_row(model))
    }

    /// A delete, through the write pipeline. As for [`write`](Self::write):
    /// when no stage has work for a row of the entity, only SeaORM's hooks
    /// with the key's checks around them and the `DELETE` run, its statement
    /// built before the await; otherwise the whole pipeline, boxed.
    async fn delete_row<A>(&self, model: A) -> Result<u64>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
    {
        let op = WriteOp::Delete;
        let name = op.as_str();
        self.check::<A::Entity>(&model)?;
        if self.stages.batch::<A::Entity>(&self.ctx(), op) != Batch::Statement {
            return Box::pin(self.delete_staged(model)).await;
        }
        crate::trace::in_span(self.write_span::<A::Entity>(name), async {
            let model = self.before_delete(model, name).await?;
            let statement = self.delete_statement::<A::Entity>(&model)?;
            let rows = crate::exec::statements::rows_affected(&self.txn, statement)
                .await
                .map_err(|e| self.write_err::<A::Entity>(name, e))?;
            A::after_delete(model, &self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>(name, e))?;
            Ok(rows)
        })
        .await
    }

    /// The `DELETE` of `model`'s row: its primary key and the transaction's
    /// key (SeaORM's `Entity::delete(model)` with the key's predicate, see
    /// [`crate::read::keyed_statement`]).
    fn delete_statement<E: InGroup<G>>(
        &self,
        model: &E::ActiveModel,
    ) -> Result<sea_orm::Statement> {
        // SeaORM's `DeleteOne` refuses a missing primary key the same way.
        let pk = self.pk_condition::<E>(model, WriteOp::Delete.as_str(), || {
            DbErr::PrimaryKeyNotSet { ctx: "DeleteOne" }
        })?;
        let delete = sea_orm::QueryTrait::into_query(E::delete_many());
        Ok(crate::read::keyed_statement::<E, _>(
            &delete,
            &self.key,
            self.backend(),
            Some(pk),
            &[],
        ))
    }

    /// [`delete_row`](Self::delete_row) with every stage of the pipeline.
    pub(super) async fn delete_staged<A>(&self, model: A) -> Result<u64>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
    {
        let op = WriteOp::Delete;
        let name = op.as_str();
        self.check::<A::Entity>(&model)?;
        let ctx = self.ctx();
        crate::trace::in_span(self.write_span::<A::Entity>(name), async {
            let model = self.before_delete(model, name).await?;
            let replaced = self
                .stages
                .replace::<A::Entity>(&ctx, op, &model)
                .await
                .map_err(|e| self.poison(e))?;
            let deleted = match replaced {
                Some(Replaced::Deleted(rows)) => rows,
                Some(Replaced::Saved(_)) => {
                    return Err(self.poison(ShardError::internal(format!(
                        "a write stage answered a delete of `{}` with a saved row",
                        table_name::<A::Entity>()
                    ))));
                }
                None => {
                    let current = if self.stages.needs_current::<A::Entity>(op) {
                        self.current_row::<A::Entity>(&model, name).await?
                    } else {
                        None
                    };
                    let delete = <A::Entity as EntityTrait>::delete(model.clone())
                        .validate()
                        .map_err(|e| self.write_err::<A::Entity>(name, e))?
                        .filter(self.key_expr::<A::Entity>());
                    let rows = delete
                        .exec(&self.txn)
                        .await
                        .map_err(|e| self.write_err::<A::Entity>(name, e))?
                        .rows_affected;
                    let written = Written::Deleted {
                        model: &model,
                        current: current.as_ref(),
                        rows,
                    };
                    self.stages
                        .after_write::<A::Entity>(&ctx, op, written)
                        .await
                        .map_err(|e| self.poison(e))?;
                    rows
                }
            };
            A::after_delete(model, &self.txn)
                .await
                .map_err(|e| self.write_err::<A::Entity>(name, e))?;
            Ok(deleted)
        })
        .await
    }

    /// Reads rows of the transaction's key, inside the transaction.
    pub fn find<E: InGroup<G>>(&self) -> TxFind<'_, E, DatabaseTransaction> {
        TxFind::new(
            &self.txn,
            self.shard(),
            &self.key,
            (&self.streams, &self.poisoned),
            self.guard.as_deref(),
        )
    }

    /// The rows of `R` related to `model` (SeaORM's
    /// [`ModelTrait::find_related`](sea_orm::ModelTrait::find_related)),
    /// inside the transaction: `R`'s rows of the transaction's key only,
    /// whatever key `model` carries.
    pub fn find_related<M, R>(&self, model: &M, related: R) -> TxFind<'_, R, DatabaseTransaction>
    where
        M: sea_orm::ModelTrait,
        M::Entity: crate::entity::ShardedEntity + sea_orm::Related<R>,
        R: InGroup<G>,
    {
        let guard = self.guard.as_deref();
        let (select, refused) = match crate::read::guard_check::<M::Entity>(guard) {
            Ok(m_from) => (
                crate::read::related_select(model, related, m_from.as_ref()),
                None,
            ),
            Err(err) => (model.find_related(related), Some(err)),
        };
        let mut find = TxFind::of(
            &self.txn,
            self.shard(),
            &self.key,
            select,
            (&self.streams, &self.poisoned),
            guard,
        );
        if let Some(err) = refused {
            find.refuse(err);
        }
        find
    }

    /// Commits. If a write was refused, rolls back instead and returns
    /// [`ShardError::RollbackOnly`]. Once committed, runs the work the
    /// write stages queued (cache fills, removal of replaced index rows).
    pub async fn commit(self) -> Result<()> {
        if let Some(reason) = self.poison_reason() {
            let shard = self.shard().to_owned();
            let ShardTx { txn, .. } = self;
            txn.rollback().await.map_err(|source| {
                ShardError::db(
                    crate::error::Origin::Group(G::NAME),
                    shard.clone(),
                    "rollback",
                    source,
                )
            })?;
            return Err(ShardError::RollbackOnly {
                group: G::NAME,
                shard,
                reason,
            });
        }
        let ShardTx {
            txn,
            shards,
            target,
            span,
            after_commit,
            _writer: writer,
            ..
        } = self;
        crate::trace::in_span(span, txn.commit())
            .await
            .map_err(|source| {
                ShardError::db(
                    crate::error::Origin::Group(G::NAME),
                    shards.shard_name(target.shard).to_owned(),
                    "commit",
                    source,
                )
            })?;
        // The SQLite write lock is released; so is the cluster's slot.
        drop(writer);
        for work in after_commit.into_inner().unwrap_or_else(|p| p.into_inner()) {
            work.await;
        }
        Ok(())
    }

    /// Commits, like [`commit`](Self::commit), and records in `session`
    /// where the commit landed in the shard's log (PostgreSQL's WAL
    /// position, MySQL/MariaDB's GTID position, read on the shard right
    /// after the commit), so that later reads with
    /// [`Consistency::AtLeast`](crate::Consistency::AtLeast) of the session
    /// see this transaction's writes. The position is read whether this
    /// instance's config lists replicas of the shard or not (the session
    /// may be read by an instance whose config does); on SQLite none is.
    /// When the position cannot be read after a commit that
    /// succeeded, the session sends the shard's reads to the shard itself
    /// from then on (never to a replica that may be older), and this still
    /// returns `Ok`: the commit happened.
    ///
    /// For a `movable` group it also records the bucket map this instance
    /// routed by, so that another instance whose map is older reads the map
    /// again before it routes a read of the session (and reads a key whose
    /// bucket moved on its new owner).
    ///
    /// When the commit fails, its outcome may be unknown (the connection
    /// lost after `COMMIT` was sent): the session records the map and sends
    /// its reads of the shard to the shard itself, as after a position it
    /// could not read, until a later commit's position is read. (Not after
    /// a commit that surely did not happen: a rollback-only transaction,
    /// one the database aborted.) The same when this stops before it has
    /// recorded the commit: its future dropped (a request's timeout, a
    /// client gone) or a panic, after `COMMIT` may have been sent.
    pub async fn commit_in(self, session: &crate::exec::Session) -> Result<()> {
        let shards = self.shards.clone();
        let id = self.target.shard;
        let epoch = match shards.topology().live_owners(G::NAME) {
            Ok(Some(map)) if shards.topology().is_movable(G::NAME) => Some(map.epoch()),
            _ => None,
        };
        let shard = shards.shard_name(id);
        let pending = crate::exec::replicas::PendingCommit {
            session,
            shard,
            backend: shards.shard_conn(id).get_database_backend(),
            epoch: epoch.map(|epoch| (G::NAME, epoch)),
        };
        let committed = self.commit().await;
        if let Some(epoch) = epoch {
            session.record_epoch(G::NAME, epoch);
        }
        if let Err(e) = committed {
            // Not for a commit that surely did not happen: rollback-only,
            // or one the database aborted.
            let unknown = !matches!(e, ShardError::RollbackOnly { .. })
                && e.retry() != crate::Retry::Transaction;
            if unknown {
                // Recorded as a commit stopped midway is.
                drop(pending);
            } else {
                pending.finished();
            }
            return Err(e);
        }
        if shards.failpoint("shardkit::tx::commit_in").is_some() {
            // Stops here as a dropped future would: `pending` records it.
            return Err(ShardError::internal(
                "failpoint shardkit::tx::commit_in: stopped after the commit",
            ));
        }
        let since = session.mark();
        if let Some(position) = shards.commit_position(id).await {
            session.record_read_after(shard, position, since);
        }
        pending.finished();
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<()> {
        let shard = self.shard().to_owned();
        let ShardTx { txn, .. } = self;
        txn.rollback().await.map_err(|source| {
            ShardError::db(
                crate::error::Origin::Group(G::NAME),
                shard,
                "rollback",
                source,
            )
        })
    }
}

/// Whether `model` sets a column other than its primary key's: an update
/// that does not writes nothing (SeaORM's `Update::one` sets no column, and
/// answers with a read by primary key alone).
fn sets_a_column<E: EntityTrait>(model: &E::ActiveModel) -> bool {
    use sea_orm::{Iterable, PrimaryKeyToColumn};
    <E::Column as Iterable>::iter().any(|column| {
        <E::PrimaryKey as PrimaryKeyToColumn>::from_column(column).is_none()
            && model.get(column).is_set()
    })
}
