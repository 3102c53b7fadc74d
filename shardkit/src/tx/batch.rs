//! Writes of several rows of the transaction's key at once:
//! [`ShardTx::save`], [`ShardTx::update_many`], [`ShardTx::delete_many`].
//!
//! A batch is one statement when no write stage has work for each of its
//! rows ([`WriteStage::batch`]: no global index, no rollout of the
//! entity). Otherwise it reads the rows it matches under the row lock and
//! writes each through the whole pipeline, so every index row and dual
//! write stays right; the rows written are the same either way. A batch
//! that fails row by row makes the transaction rollback-only, so it is all
//! or nothing like the one statement.

use crate::boxed::boxed;
use crate::entity::{EntityGroup, InGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::pipeline::{Batch, WriteOp, WriteStage};
use crate::tx::ShardTx;
use futures::future::BoxFuture;
use sea_orm::sea_query::{IntoCondition, SimpleExpr};
use sea_orm::{
    ActiveModelBehavior, ActiveModelTrait, ActiveValue, Condition, EntityTrait, IdenStatic,
    IntoActiveModel, Iterable, QueryFilter, QuerySelect,
};

impl<G: EntityGroup, P: WriteStage> ShardTx<G, P> {
    /// Inserts the row when its primary key is not fully set, updates it
    /// otherwise, and returns it as stored, as SeaORM's
    /// [`ActiveModelTrait::save`] does; both through the write pipeline
    /// (with `#[shardkit(id = "...")]`, an unset id is filled and the row
    /// inserted).
    pub fn save<A>(&self, model: A) -> BoxFuture<'_, Result<A>>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        boxed(|| self.save_row(model))
    }

    async fn save_row<A>(&self, model: A) -> Result<A>
    where
        A: ActiveModelTrait + ActiveModelBehavior + Send + 'static,
        A::Entity: InGroup<G> + EntityTrait<ActiveModel = A>,
        <A::Entity as EntityTrait>::Model: IntoActiveModel<A>,
    {
        let update = <<A::Entity as EntityTrait>::PrimaryKey as Iterable>::iter()
            .all(|key| !model.is_not_set(sea_orm::PrimaryKeyToColumn::into_column(key)));
        let op = if update {
            WriteOp::Update
        } else {
            WriteOp::Insert
        };
        let row = self.write::<A::Entity>(op, model).await?;
        Ok(row.into_active_model())
    }

    /// Updates every row of `E` of the transaction's key that the filters
    /// match, like SeaORM's [`EntityTrait::update_many`]: the shard-key
    /// predicate is always added, so no other key's row is touched.
    ///
    /// ```
    /// # use shardkit::prelude::*;
    /// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Customer;
    /// # pub mod order {
    /// #     use sea_orm::entity::prelude::*;
    /// #     #[sea_orm::model]
    /// #     #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    /// #     #[sea_orm(table_name = "orders")]
    /// #     #[shardkit(group = crate::Customer)]
    /// #     pub struct Model {
    /// #         #[sea_orm(primary_key, auto_increment = false)]
    /// #         pub id: i64,
    /// #         #[shardkit(shard_key)]
    /// #         pub customer_id: i64,
    /// #         pub status: String,
    /// #     }
    /// #     impl ActiveModelBehavior for ActiveModel {}
    /// # }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let cluster = Cluster::connect(ClusterConfig::from_toml(
    /// #     "shards = [{ name = \"s0\", url = \"sqlite::memory:\" }]\n[groups.Customer]\n",
    /// # )?).await?;
    /// # {
    /// #     use sea_orm::ConnectionTrait;
    /// #     let db = cluster.connection("s0").unwrap();
    /// #     let schema = sea_orm::Schema::new(db.get_database_backend());
    /// #     db.execute(&schema.create_table_from_entity(order::Entity)).await?;
    /// # }
    /// let tx = cluster.begin::<Customer>(42).await?;
    /// # for (id, status) in [(1, "paid"), (2, "paid"), (3, "open")] {
    /// #     tx.insert(order::ActiveModel { id: Set(id), customer_id: Set(42), status: Set(status.into()) }).await?;
    /// # }
    /// let shipped = tx
    ///     .update_many::<order::Entity>()
    ///     .set(order::ActiveModel { status: Set("shipped".into()), ..Default::default() })
    ///     .filter(order::Column::Status.eq("paid"))
    ///     .exec()
    ///     .await?;
    /// assert_eq!(shipped, 2);
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub fn update_many<E: InGroup<G>>(&self) -> TxUpdateMany<'_, G, P, E> {
        TxUpdateMany {
            tx: self,
            set: E::ActiveModel::default(),
            set_columns: Vec::new(),
            exprs: Vec::new(),
            filter: None,
            run: |batch| boxed(|| batch.run()),
        }
    }

    /// Deletes every row of `E` of the transaction's key that the filters
    /// match, like SeaORM's [`EntityTrait::delete_many`]: the shard-key
    /// predicate is always added.
    pub fn delete_many<E: InGroup<G>>(&self) -> TxDeleteMany<'_, G, P, E> {
        TxDeleteMany {
            tx: self,
            filter: None,
            entity: std::marker::PhantomData,
            run: |batch| boxed(|| batch.run()),
        }
    }

    /// The rows of `E` of the key that `filter` matches, read under the row
    /// lock the batch's writes will take.
    async fn rows_for_batch<E: InGroup<G>>(
        &self,
        filter: Option<Condition>,
        op: &str,
    ) -> Result<Vec<E::Model>> {
        let mut select = E::find().filter(self.key_expr::<E>());
        if let Some(filter) = filter {
            select = select.filter(filter);
        }
        if self.backend() != sea_orm::DbBackend::Sqlite {
            select = select.lock_exclusive();
        }
        select
            .all(&self.txn)
            .await
            .map_err(|e| self.write_err::<E>(op, e))
    }
}

/// `filter` and `condition`, combined with `AND` whatever the first one's
/// own kind (`Condition::add` would join `condition` into an `any` or a
/// negated first filter).
fn and(filter: Option<Condition>, condition: impl IntoCondition) -> Condition {
    match filter {
        None => condition.into_condition(),
        Some(filter) => Condition::all().add(filter).add(condition.into_condition()),
    }
}

/// A batch of `E` that shardkit refuses, before any I/O.
fn unsupported<E: EntityTrait>(operation: &'static str, reason: String) -> ShardError {
    ShardError::Unsupported {
        table: table_name::<E>(),
        operation,
        reason,
    }
}

/// An update of the rows of one key that match its filters
/// ([`ShardTx::update_many`]). Runs on [`exec`](Self::exec).
#[must_use = "an update does nothing until `.exec()` runs it"]
pub struct TxUpdateMany<'t, G: EntityGroup, P, E: ShardedEntity> {
    tx: &'t ShardTx<G, P>,
    set: E::ActiveModel,
    /// The columns `set` has `Set`, in the entity's order.
    set_columns: Vec<E::Column>,
    exprs: Vec<(E::Column, SimpleExpr)>,
    /// The filters, `None` before the first (not nested in an empty
    /// condition: the statement takes the caller's as it is).
    filter: Option<Condition>,
    /// How `exec` runs it, chosen by `update_many` where `E` is known to be
    /// of `G` (the builder's own methods need no such bound, so writing
    /// another group's entity fails to compile once, at `update_many`).
    run: for<'a> fn(TxUpdateMany<'a, G, P, E>) -> BoxFuture<'a, Result<u64>>,
}

impl<'t, G: EntityGroup, P: WriteStage, E: ShardedEntity> TxUpdateMany<'t, G, P, E> {
    /// The values to set: every column `model` has `Set` (SeaORM's
    /// `UpdateMany::set`). Setting the shard key to another key is refused
    /// as a [`ShardError::CrossShardWrite`].
    pub fn set(mut self, model: E::ActiveModel) -> Self {
        for column in <E::Column as Iterable>::iter() {
            if let ActiveValue::Set(value) = model.get(column) {
                // The value came out of an ActiveModel of the same entity,
                // so its type fits the column.
                let _ = self.set.try_set(column, value);
            }
        }
        self.set_columns = <E::Column as Iterable>::iter()
            .filter(|c| matches!(self.set.get(*c), ActiveValue::Set(_)))
            .collect();
        self
    }

    /// Sets `column` to a SQL expression (SeaORM's `UpdateMany::col_expr`),
    /// e.g. `Expr::col(order::Column::Total).add(1)`. Only for entities
    /// whose rows need no per-row work (no global index, no rollout): an
    /// index row needs the new value before the write. Elsewhere `exec`
    /// refuses it with [`ShardError::Unsupported`] before any I/O.
    pub fn col_expr(mut self, column: E::Column, expr: impl Into<SimpleExpr>) -> Self {
        self.exprs.push((column, expr.into()));
        self
    }

    /// Adds a condition (SeaORM's `QueryFilter::filter`); conditions are
    /// combined with `AND`, and always with the shard key's.
    pub fn filter(mut self, condition: impl IntoCondition) -> Self {
        self.filter = Some(and(self.filter, condition));
        self
    }

    /// Runs the update; returns how many rows it matched (SeaORM's
    /// `UpdateResult::rows_affected`).
    pub fn exec(self) -> BoxFuture<'t, Result<u64>> {
        (self.run)(self)
    }
}

impl<'t, G: EntityGroup, P: WriteStage, E: InGroup<G>> TxUpdateMany<'t, G, P, E> {
    async fn run(self) -> Result<u64> {
        let TxUpdateMany {
            tx,
            set,
            set_columns,
            exprs,
            filter,
            run: _,
        } = self;
        let op = "update_many";
        tx.ensure_open()?;
        // With no column set, `set` is the default model: no key in it.
        let set_key = if set_columns.is_empty() {
            None
        } else {
            E::active_shard_key(&set)
        };
        if let Some(found) = set_key.filter(|k| *k != tx.key) {
            return Err(tx.poison(ShardError::CrossShardWrite {
                entity: table_name::<E>(),
                column: E::SHARD_KEY_FIELD,
                expected: format!("{:?}", tx.key),
                found: format!("{found:?}"),
            }));
        }
        let key_column = E::shard_key_column();
        if exprs.iter().any(|(c, _)| c.as_str() == key_column.as_str()) {
            return Err(tx.poison(ShardError::CrossShardWrite {
                entity: table_name::<E>(),
                column: E::SHARD_KEY_FIELD,
                expected: format!("{:?}", tx.key),
                found: "an expression".to_owned(),
            }));
        }
        let refuse = |reason: &str| unsupported::<E>(op, reason.to_owned());
        let primary = |column: &E::Column| {
            <E::PrimaryKey as Iterable>::iter().any(|key| {
                sea_orm::PrimaryKeyToColumn::into_column(key).as_str() == column.as_str()
            })
        };
        if set_columns
            .iter()
            .chain(exprs.iter().map(|(c, _)| c))
            .any(primary)
        {
            return Err(refuse(
                "it sets a primary-key column: change a row's primary key with `update` of \
                 that row, or insert a new row and delete the old one",
            ));
        }
        if set_columns.is_empty() && exprs.is_empty() {
            return Err(refuse(
                "nothing to set: give values with `.set(..)` or `.col_expr(..)`",
            ));
        }
        match tx.stages.batch::<E>(&tx.ctx(), WriteOp::Update) {
            Batch::Statement => {
                // Built before the await: the future holds the statement's
                // text, not the sea-query statement.
                let statement = {
                    let mut update = E::update_many();
                    if !set_columns.is_empty() {
                        update = update.set(set);
                    }
                    let mut update = sea_orm::QueryTrait::into_query(update);
                    // SeaORM's `col_expr`, on the statement in place.
                    for (column, expr) in exprs {
                        update.value(column, expr);
                    }
                    crate::read::keyed_statement::<E, _>(
                        &update,
                        &tx.key,
                        tx.backend(),
                        filter,
                        &[],
                    )
                };
                return crate::exec::statements::rows_affected(&tx.txn, statement)
                    .await
                    .map_err(|e| tx.write_err::<E>(op, e));
            }
            Batch::Refused(reason) => return Err(refuse(&reason)),
            Batch::PerRow => {}
        }
        if !exprs.is_empty() {
            return Err(refuse(
                "`col_expr` on an entity with a global index or a rollout: their rows need each \
                 row's new value before it is written; set values with `.set(..)` instead, or \
                 read the rows and update each",
            ));
        }
        // Boxed: the pipeline's state would otherwise sit in the one
        // statement's future (one allocation of kilobytes per batch).
        Box::pin(tx.update_rows::<E>(filter, set, set_columns)).await
    }
}

impl<G: EntityGroup, P: WriteStage> ShardTx<G, P> {
    /// [`TxUpdateMany`] row by row: each row the filter matches through
    /// the whole pipeline.
    async fn update_rows<E: InGroup<G>>(
        &self,
        filter: Option<Condition>,
        set: E::ActiveModel,
        set_columns: Vec<E::Column>,
    ) -> Result<u64> {
        let op = "update_many";
        let rows = self.rows_for_batch::<E>(filter, op).await?;
        let mut changed = 0;
        for row in rows {
            let mut model = row.into_active_model();
            for column in &set_columns {
                if let ActiveValue::Set(value) = set.get(*column) {
                    model
                        .try_set(*column, value)
                        .map_err(|e| self.poison(self.write_err::<E>(op, e)))?;
                }
            }
            // All or nothing, like the one statement: a row that fails
            // leaves the rows before it written, so nothing may commit.
            self.write_staged::<E>(WriteOp::Update, model)
                .await
                .map_err(|e| self.poison(e))?;
            changed += 1;
        }
        Ok(changed)
    }
}

/// A delete of the rows of one key that match its filters
/// ([`ShardTx::delete_many`]). Runs on [`exec`](Self::exec).
#[must_use = "a delete does nothing until `.exec()` runs it"]
pub struct TxDeleteMany<'t, G: EntityGroup, P, E: ShardedEntity> {
    tx: &'t ShardTx<G, P>,
    /// As [`TxUpdateMany`]'s.
    filter: Option<Condition>,
    entity: std::marker::PhantomData<fn() -> E>,
    /// As [`TxUpdateMany`]'s.
    run: for<'a> fn(TxDeleteMany<'a, G, P, E>) -> BoxFuture<'a, Result<u64>>,
}

impl<'t, G: EntityGroup, P: WriteStage, E: ShardedEntity> TxDeleteMany<'t, G, P, E> {
    /// Adds a condition (SeaORM's `QueryFilter::filter`); conditions are
    /// combined with `AND`, and always with the shard key's.
    pub fn filter(mut self, condition: impl IntoCondition) -> Self {
        self.filter = Some(and(self.filter, condition));
        self
    }

    /// Runs the delete; returns how many rows it removed (SeaORM's
    /// `DeleteResult::rows_affected`).
    pub fn exec(self) -> BoxFuture<'t, Result<u64>> {
        (self.run)(self)
    }
}

impl<'t, G: EntityGroup, P: WriteStage, E: InGroup<G>> TxDeleteMany<'t, G, P, E> {
    async fn run(self) -> Result<u64> {
        let TxDeleteMany { tx, filter, .. } = self;
        let op = "delete_many";
        tx.ensure_open()?;
        match tx.stages.batch::<E>(&tx.ctx(), WriteOp::Delete) {
            Batch::Statement => {
                // Built before the await: the future holds the statement's
                // text, not the sea-query statement.
                let statement = {
                    let delete = sea_orm::QueryTrait::into_query(E::delete_many());
                    crate::read::keyed_statement::<E, _>(
                        &delete,
                        &tx.key,
                        tx.backend(),
                        filter,
                        &[],
                    )
                };
                return crate::exec::statements::rows_affected(&tx.txn, statement)
                    .await
                    .map_err(|e| tx.write_err::<E>(op, e));
            }
            Batch::Refused(reason) => return Err(unsupported::<E>(op, reason)),
            Batch::PerRow => {}
        }
        // Boxed, as `TxUpdateMany`'s rows.
        Box::pin(tx.delete_rows::<E>(filter)).await
    }
}

impl<G: EntityGroup, P: WriteStage> ShardTx<G, P> {
    /// [`TxDeleteMany`] row by row: each row the filter matches through
    /// the whole pipeline.
    async fn delete_rows<E: InGroup<G>>(&self, filter: Option<Condition>) -> Result<u64> {
        let rows = self.rows_for_batch::<E>(filter, "delete_many").await?;
        let mut deleted = 0;
        for row in rows {
            // All or nothing, as for `update_many`.
            deleted += self
                .delete_staged(row.into_active_model())
                .await
                .map_err(|e| self.poison(e))?;
        }
        Ok(deleted)
    }
}
