//! The parts of a fold: the rows folded into one root row ([`Parts`]) and how each part entity is read and written ([`PartDef`]).

use crate::entity::{ShardKey, ShardedEntity, table_name};
use crate::exec::keyset::{by_pk, pk_condition, tuple_text};
use crate::read::KeyOf;
use crate::rollout::{ActiveValues, RowValues, cache_key};
use futures::future::BoxFuture;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseExecutor, DatabaseTransaction, DbErr,
    EntityTrait, IntoActiveModel, Iterable, ModelTrait, PrimaryKeyToColumn, QueryFilter,
    QuerySelect, Value,
};
use std::any::{Any, TypeId};
use std::collections::HashMap;

/// The rows folded into one root row, by entity: what a fold's `to_new`
/// reads ([`Rollout::fold`](crate::rollout::Rollout::fold)) and its `to_old_parts` builds
/// ([`Rollout::to_old_parts`](crate::rollout::Rollout::to_old_parts)).
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
