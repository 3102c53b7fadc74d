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
use crate::exec::keyset::{by_pk, pk_condition, tuple_text};
use crate::phase::Phase;
use crate::rollout::{
    ActiveValues, AfterCommit, KeyOf, OldReads, OldWrites, RowValues, Shared, WriteCtx, cache_key,
};
use futures::future::BoxFuture;
use sea_orm::{
    ActiveModelTrait, ActiveValue, ColumnTrait, ConnectionTrait, DatabaseExecutor,
    DatabaseTransaction, DbErr, EntityTrait, IntoActiveModel, Iterable, ModelTrait,
    PrimaryKeyToColumn, QueryFilter, QuerySelect, TryIntoModel, Value,
};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

/// The rows folded into one root row, by entity: what a fold's `to_new`
/// reads ([`Rollout::fold`]) and its `to_old_parts` builds
/// ([`Rollout::to_old_parts`]).
#[derive(Default)]
pub struct Parts {
    rows: HashMap<TypeId, Box<dyn Any + Send + Sync>>,
}

impl Parts {
    /// No parts.
    pub fn new() -> Self {
        Self::default()
    }

    /// These parts and `rows`, the rows of entity `P` (replacing any
    /// given before).
    pub fn with<P: EntityTrait>(mut self, rows: Vec<P::Model>) -> Self
    where
        P::Model: Sync,
    {
        self.rows.insert(TypeId::of::<P>(), Box::new(rows));
        self
    }

    /// The rows of entity `P` that fold into the root, in primary-key order
    /// (empty when there are none).
    pub fn many<P: EntityTrait>(&self) -> &[P::Model]
    where
        P::Model: Sync,
    {
        self.rows
            .get(&TypeId::of::<P>())
            .and_then(|rows| rows.downcast_ref::<Vec<P::Model>>())
            .map_or(&[], Vec::as_slice)
    }

    /// The row of entity `P` that folds into the root (a one-to-one part),
    /// or the first of several.
    pub fn one<P: EntityTrait>(&self) -> Option<&P::Model>
    where
        P::Model: Sync,
    {
        self.many::<P>().first()
    }

    pub(super) fn rows_mut<P: EntityTrait>(&mut self) -> &mut Vec<P::Model>
    where
        P::Model: Sync,
    {
        self.rows
            .entry(TypeId::of::<P>())
            .or_insert_with(|| Box::new(Vec::<P::Model>::new()))
            .downcast_mut::<Vec<P::Model>>()
            .expect("the rows of an entity are a Vec of its model")
    }
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("entities", &self.rows.len())
            .finish()
    }
}

/// What a part write did to the folded row (from `new_only` on).
pub(super) enum Applied {
    /// The part row as written.
    Saved(RowValues),
    /// Rows removed.
    Deleted(u64),
}

/// One part of a fold, whatever its entity: what the rollout, typed by its
/// root only, needs to do with it.
pub(crate) trait PartDef<Old: ShardedEntity>: Send + Sync
where
    Old::Model: Sync,
{
    /// The part entity's type.
    fn entity(&self) -> TypeId;
    /// Its table.
    fn table(&self) -> &'static str;
    /// Its link column's name.
    fn link(&self) -> &'static str;
    /// Its link column's position among the part's columns.
    fn link_position(&self) -> usize;
    /// Adds to `parts[i]` the rows that fold into `roots[i]`, read on `db`
    /// (with a locking read on MySQL when `lock`, see the module docs).
    fn load<'a>(
        &'a self,
        db: &'a DatabaseExecutor<'a>,
        roots: &'a [Old::Model],
        parts: &'a mut [Parts],
        lock: bool,
    ) -> BoxFuture<'a, std::result::Result<(), DbErr>>;
    /// The shard key, link value and primary key of the part row `model`
    /// names, as far as they are set.
    fn key_link_pk(
        &self,
        model: &ActiveValues,
    ) -> (Option<KeyOf<Old>>, Option<Value>, Option<Vec<Value>>);
    /// The link value of the part row with primary key `pk` as stored now
    /// (without a lock: the pipeline locks the row after its roots).
    fn stored_link<'a>(
        &'a self,
        txn: &'a DatabaseTransaction,
        key: &'a KeyOf<Old>,
        pk: &'a [Value],
    ) -> BoxFuture<'a, std::result::Result<Option<Value>, DbErr>>;
    /// Applies a write of the part (`op`, the active model `model`) to the
    /// root's `parts`: an insert adds the row, an update changes its set
    /// columns, a delete removes it. `Err` names what is wrong.
    fn apply(
        &self,
        parts: &mut Parts,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> std::result::Result<Applied, DbErr>;
}

/// Whether primary key `a` sorts before `b`, value by value, typed (so
/// `9 < 10`), as the database orders them.
fn pk_less(a: &[Value], b: &[Value]) -> bool {
    for (x, y) in a.iter().zip(b) {
        match crate::read::compare_values(x, y, true) {
            Some(std::cmp::Ordering::Equal) | None => continue,
            Some(order) => return order == std::cmp::Ordering::Less,
        }
    }
    false
}

/// The part `P` of a fold, linked by `link`.
pub(super) struct PartOf<P: EntityTrait> {
    link: P::Column,
}

impl<P: EntityTrait> PartOf<P> {
    pub(super) fn new(link: P::Column) -> Self {
        PartOf { link }
    }

    fn position(pk: &[Value], rows: &[P::Model]) -> Option<usize> {
        rows.iter()
            .position(|row| crate::key::model_pk_values::<P>(row).as_slice() == pk)
    }
}

impl<Old, P> PartDef<Old> for PartOf<P>
where
    Old: ShardedEntity,
    Old::Model: Sync,
    P: ShardedEntity<Group = Old::Group>,
    P::Model: Sync + IntoActiveModel<P::ActiveModel>,
    P::ActiveModel: Send + Sync,
{
    fn entity(&self) -> TypeId {
        TypeId::of::<P>()
    }

    fn table(&self) -> &'static str {
        table_name::<P>()
    }

    fn link(&self) -> &'static str {
        sea_orm::IdenStatic::as_str(&self.link)
    }

    fn link_position(&self) -> usize {
        let link = sea_orm::IdenStatic::as_str(&self.link);
        <P::Column as Iterable>::iter()
            .position(|c| sea_orm::IdenStatic::as_str(&c) == link)
            .expect("the link is a column of the part")
    }

    fn load<'a>(
        &'a self,
        db: &'a DatabaseExecutor<'a>,
        roots: &'a [Old::Model],
        parts: &'a mut [Parts],
        lock: bool,
    ) -> BoxFuture<'a, std::result::Result<(), DbErr>> {
        Box::pin(async move {
            if roots.is_empty() {
                return Ok(());
            }
            // Each root by shard key and primary key, as the parts name it.
            let mut index: HashMap<String, usize> = HashMap::with_capacity(roots.len());
            let mut keys: Vec<KeyOf<Old>> = Vec::new();
            let mut links: Vec<Value> = Vec::with_capacity(roots.len());
            for (i, root) in roots.iter().enumerate() {
                let key = Old::shard_key(root);
                let key_text = key.to_directory_text();
                if !keys.iter().any(|k| k.to_directory_text() == key_text) {
                    keys.push(key);
                }
                let pk = crate::key::model_pk_values::<Old>(root);
                index.insert(cache_key(&key_text, &tuple_text(&pk)), i);
                links.extend(pk.into_iter().take(1));
            }
            let backend = db.get_database_backend();
            let mut select = by_pk(
                P::find()
                    .filter(crate::read::key_condition::<P>(&keys, backend))
                    .filter(if links.len() == 1 {
                        self.link.eq(links.pop().expect("one link"))
                    } else {
                        self.link.is_in(links)
                    }),
            );
            if lock && backend == sea_orm::DbBackend::MySql {
                select = select.lock_shared();
            }
            for row in select.all(db).await? {
                let at = cache_key(
                    &P::shard_key(&row).to_directory_text(),
                    &tuple_text(&[row.get(self.link)]),
                );
                if let Some(&i) = index.get(&at) {
                    parts[i].rows_mut::<P>().push(row);
                }
            }
            Ok(())
        })
    }

    fn key_link_pk(
        &self,
        model: &ActiveValues,
    ) -> (Option<KeyOf<Old>>, Option<Value>, Option<Vec<Value>>) {
        let Ok((active, _)) = crate::key::active_from_values::<P>(model.clone()) else {
            return (None, None, None);
        };
        let key = P::active_shard_key(&active);
        let link = active.get(self.link).into_value();
        let pk = <P::PrimaryKey as Iterable>::iter()
            .map(|pk| active.get(pk.into_column()).into_value())
            .collect::<Option<Vec<Value>>>();
        (key, link, pk)
    }

    fn stored_link<'a>(
        &'a self,
        txn: &'a DatabaseTransaction,
        key: &'a KeyOf<Old>,
        pk: &'a [Value],
    ) -> BoxFuture<'a, std::result::Result<Option<Value>, DbErr>> {
        Box::pin(async move {
            let backend = txn.get_database_backend();
            let select = P::find()
                .filter(crate::read::key_condition::<P>(
                    std::slice::from_ref(key),
                    backend,
                ))
                .filter(pk_condition::<P>(pk));
            Ok(select.one(txn).await?.map(|row| row.get(self.link)))
        })
    }

    fn apply(
        &self,
        parts: &mut Parts,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> std::result::Result<Applied, DbErr> {
        use crate::pipeline::WriteOp;
        let (active, set) = crate::key::active_from_values::<P>(model)?;
        let pk: Vec<Value> = <P::PrimaryKey as Iterable>::iter()
            .map(|pk| active.get(pk.into_column()).into_value())
            .collect::<Option<_>>()
            .ok_or(DbErr::PrimaryKeyNotSet { ctx: "rollout" })?;
        let rows = parts.rows_mut::<P>();
        let at = Self::position(&pk, rows);
        match op {
            WriteOp::Insert => {
                if at.is_some() {
                    return Err(DbErr::RecordNotInserted);
                }
                let row = P::__try_into_model(active)?;
                let values = crate::key::model_values::<P>(&row);
                // In primary-key order, as a read of the part table gives.
                let at = rows
                    .iter()
                    .position(|r| pk_less(&pk, &crate::key::model_pk_values::<P>(r)))
                    .unwrap_or(rows.len());
                rows.insert(at, row);
                Ok(Applied::Saved(values))
            }
            WriteOp::Update => {
                let at = at.ok_or(DbErr::RecordNotUpdated)?;
                let mut merged = rows[at].clone().into_active_model();
                for (column, set) in <P::Column as Iterable>::iter().zip(set) {
                    if set {
                        merged.set(
                            column,
                            active.get(column).into_value().unwrap_or(Value::Bool(None)),
                        );
                    }
                }
                let row = P::__try_into_model(merged)?;
                let values = crate::key::model_values::<P>(&row);
                rows[at] = row;
                Ok(Applied::Saved(values))
            }
            WriteOp::Delete => Ok(Applied::Deleted(match at {
                Some(at) => {
                    rows.remove(at);
                    1
                }
                None => 0,
            })),
        }
    }
}

impl<Old, New> Shared<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
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
    pub(super) async fn fold_in(
        &self,
        ctx: &WriteCtx<'_>,
        root: &Old::Model,
    ) -> Result<New::Model> {
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
        ctx: &WriteCtx<'_>,
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
        ctx: &WriteCtx<'_>,
        key: &KeyOf<Old>,
        pk: &Value,
        write: bool,
    ) -> Result<AfterCommit> {
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
    Old::Model: Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
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

/// The write side of one part of a fold, keyed in the registry by the part
/// entity's type: what a write of the part does to its root's new row.
///
/// Lock order, on every backend: the roots a write touches (sorted), then
/// the part's own row, then (after the write) the re-folds, which read the
/// roots again under locks they already hold. A root's own writes lock the
/// root and then read its parts, so no two transactions wait on each other
/// in opposite orders through a fold.
pub(super) struct PartWrites<Old: ShardedEntity, New: ShardedEntity> {
    pub(super) shared: Arc<Shared<Old, New>>,
    pub(super) part: usize,
}

impl<Old, New> PartWrites<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
    Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
{
    fn def(&self) -> &dyn PartDef<Old> {
        &*self.shared.parts[self.part]
    }

    fn refused_if_done(&self) -> Result<()> {
        if self.shared.phase() == Phase::Done {
            return Err(self.shared.refused_err(format!(
                "`{}` is folded into `{}`, whose old tables are retired; write `{}` instead",
                self.def().table(),
                table_name::<New>(),
                table_name::<New>()
            )));
        }
        Ok(())
    }

    fn missing(&self, what: &str) -> ShardError {
        self.shared.refused_err(format!(
            "a write of `{}` folded into `{}` must carry its {what}",
            self.def().table(),
            table_name::<New>()
        ))
    }

    /// Locks the roots an update or delete of the part touches before the
    /// part's own row: the one it names now (as the write's model says, or
    /// read without a lock) and the one it moves to, in sorted order.
    async fn lock_roots(
        &self,
        ctx: &WriteCtx<'_>,
        key: &KeyOf<Old>,
        pk: &[Value],
        named: Option<Value>,
        moving_to: Option<Value>,
    ) -> Result<()> {
        let def = self.def();
        let err = |e| {
            self.shared
                .db_err(ctx.shard, format!("select {}", def.table()), e)
        };
        let guess = match named {
            Some(link) => Some(link),
            None => def.stored_link(ctx.txn, key, pk).await.map_err(err)?,
        };
        let mut roots: Vec<Value> = guess.into_iter().chain(moving_to).collect();
        roots.sort_by_key(|v| tuple_text(std::slice::from_ref(v)));
        roots.dedup();
        for root in &roots {
            self.shared.lock_root(ctx, key, root).await?;
        }
        // The pipeline then reads the part's row under its lock; if a move
        // committed since the guess, the re-fold after the write locks the
        // root it names out of order (only a concurrent move of this very
        // row makes that happen, and a deadlock it may cause is reported as
        // one: retry the transaction).
        Ok(())
    }

    /// From `new_only` on: the write of a part applied to its root's folded
    /// row (read under its row lock, split with `to_old` and `to_old_parts`,
    /// changed, folded again).
    async fn apply_new_only(
        &self,
        ctx: &WriteCtx<'_>,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> Result<(Applied, AfterCommit)> {
        let def = self.def();
        let (key, link, _) = def.key_link_pk(&model);
        let Some(key) = key else {
            return Err(self.missing("shard key"));
        };
        let Some(link) = link else {
            return Err(self.missing(&format!(
                "`{}` (the column that names its root; in {} the folded row is found by it)",
                def.link(),
                self.phase()
            )));
        };
        let shared = &self.shared;
        let what = format!(
            "{} {} (as {})",
            op.as_str(),
            def.table(),
            table_name::<New>()
        );
        let Some(current) = shared
            .new_row_in(ctx, &key, std::slice::from_ref(&link))
            .await?
        else {
            return Err(shared.db_err(
                ctx.shard,
                what,
                DbErr::RecordNotFound(format!(
                    "no `{}` row with primary key {} under this key for `{}`.`{}` to fold into",
                    table_name::<New>(),
                    tuple_text(std::slice::from_ref(&link)),
                    def.table(),
                    def.link()
                )),
            ));
        };
        let (Some(to_old), Some(to_old_parts)) = (&shared.to_old, &shared.to_old_parts) else {
            return Err(shared.refused_err(format!(
                "in {} a write of `{}` is applied to the folded row, which needs \
                 Rollout::to_old and Rollout::to_old_parts",
                self.phase(),
                def.table()
            )));
        };
        let root = to_old(&current);
        let mut parts = to_old_parts(&current);
        let applied = def.apply(&mut parts, op, model).map_err(|e| match e {
            DbErr::RecordNotUpdated => shared.refused_err(format!(
                "in {}, `{}` row to update is not among the rows folded into `{}` {}: it does \
                 not exist, or the update moves it to another `{}` (not supported from \
                 new_only on: delete it and insert it there)",
                self.phase(),
                def.table(),
                table_name::<New>(),
                tuple_text(std::slice::from_ref(&link)),
                def.link()
            )),
            DbErr::RecordNotInserted => shared.refused_err(format!(
                "`{}` already holds this `{}` row (duplicate primary key)",
                table_name::<New>(),
                def.table()
            )),
            other => shared.db_err(ctx.shard, what.clone(), other),
        })?;
        let new = (shared.to_new)(&root, &parts);
        shared.write_new(ctx, &root, new.clone(), false).await?;
        Ok((applied, shared.self_arc().fill_both(root, new)))
    }
}

/// Both cache updates, in order.
fn both(a: AfterCommit, b: AfterCommit) -> AfterCommit {
    Box::new(move || {
        a();
        b();
    })
}

impl<Old, New> OldWrites for PartWrites<Old, New>
where
    Old: ShardedEntity,
    New: ShardedEntity<Group = Old::Group>,
    Old::Model: Sync + IntoActiveModel<Old::ActiveModel>,
    Old::ActiveModel: TryIntoModel<Old::Model> + Send + Sync,
    New::Model: Sync + IntoActiveModel<New::ActiveModel>,
    New::ActiveModel: Send,
{
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn phase(&self) -> Phase {
        self.shared.phase()
    }

    fn old_reads(&self) -> OldReads {
        let phase = self.phase();
        if phase >= Phase::NewOnly {
            return OldReads::Refused(format!(
                "in {phase} the table `{}` (folded into `{}`) is no longer written, and its rows \
                 cannot be read from the folded table: read them with the rollout's \
                 `get_parts(key, id)` (and the root with `get_old(key, id)`), or read `{}`",
                self.def().table(),
                table_name::<New>(),
                table_name::<New>()
            ));
        }
        OldReads::Old
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn needs_current(&self) -> bool {
        true
    }

    fn before_write<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        op: crate::pipeline::WriteOp,
        model: ActiveValues,
    ) -> BoxFuture<'a, Result<Option<AfterCommit>>> {
        use crate::pipeline::WriteOp;
        Box::pin(async move {
            self.refused_if_done()?;
            if !self.phase().caches() {
                return Ok(None);
            }
            let (key, link, pk) = self.def().key_link_pk(&model);
            let Some(key) = key else {
                return Err(self.missing("shard key"));
            };
            if op == WriteOp::Insert {
                if let Some(link) = &link {
                    self.shared.lock_root(&ctx, &key, link).await?;
                }
                return Ok(None);
            }
            let Some(pk) = pk else {
                return Err(self.missing("primary key"));
            };
            let (named, moving_to) = match &model[self.def().link_position()] {
                ActiveValue::Unchanged(v) => (Some(v.clone()), None),
                ActiveValue::Set(v) if op == WriteOp::Update => (None, Some(v.clone())),
                _ => (None, None),
            };
            self.lock_roots(&ctx, &key, &pk, named, moving_to).await?;
            Ok(None)
        })
    }

    fn after_write<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        row: RowValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<Option<AfterCommit>>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let phase = self.phase();
            if !phase.caches() {
                return Ok(None);
            }
            let model: ActiveValues = row.into_iter().map(ActiveValue::Set).collect();
            let (Some(key), Some(link), _) = self.def().key_link_pk(&model) else {
                return Ok(None);
            };
            let shared = self.shared.self_arc();
            let after = shared.refold(&ctx, &key, &link, phase.writes_new()).await?;
            // Moved to another root: the one it left is folded without it.
            let left = current
                .map(|row| row[self.def().link_position()].clone())
                .filter(|before| *before != link);
            match left {
                Some(before) => {
                    let other = shared
                        .refold(&ctx, &key, &before, phase.writes_new())
                        .await?;
                    Ok(Some(both(after, other)))
                }
                None => Ok(Some(after)),
            }
        })
    }

    fn after_delete<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
        current: Option<RowValues>,
    ) -> BoxFuture<'a, Result<(u64, Option<AfterCommit>)>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let phase = self.phase();
            if phase >= Phase::NewOnly {
                let (saved, after) = self
                    .apply_new_only(&ctx, crate::pipeline::WriteOp::Delete, model)
                    .await?;
                return match saved {
                    Applied::Deleted(n) => Ok((n, Some(after))),
                    Applied::Saved(_) => Ok((1, Some(after))),
                };
            }
            // The row is gone: its root, as it was, is folded without it.
            let (Some(current), true) = (current, phase.caches()) else {
                return Ok((0, None));
            };
            let link = current[self.def().link_position()].clone();
            let (Some(key), _, _) = self.def().key_link_pk(&model) else {
                return Err(self.missing("shard key"));
            };
            let shared = self.shared.self_arc();
            let after = shared.refold(&ctx, &key, &link, phase.writes_new()).await?;
            Ok((0, Some(after)))
        })
    }

    fn write_new_only<'a>(
        &'a self,
        ctx: WriteCtx<'a>,
        model: ActiveValues,
        update: bool,
    ) -> BoxFuture<'a, Result<(RowValues, AfterCommit)>> {
        Box::pin(async move {
            self.refused_if_done()?;
            let op = if update {
                crate::pipeline::WriteOp::Update
            } else {
                crate::pipeline::WriteOp::Insert
            };
            match self.apply_new_only(&ctx, op, model).await? {
                (Applied::Saved(row), after) => Ok((row, after)),
                (Applied::Deleted(_), _) => Err(self
                    .shared
                    .refused_err("internal: a part write answered with a delete")),
            }
        })
    }
}
