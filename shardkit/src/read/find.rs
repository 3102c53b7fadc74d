//! [`Find`], the read a user builds, and the single-key SeaORM selects.

use crate::boxed::boxed;
use crate::entity::{EntityGroup, InGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::read::index::IndexLookup;
use crate::read::keys::{guard_check, join_related};
use crate::read::plan::{ReadOp, ReadPlan};
use crate::read::request::Read;
use crate::read::route::{AllowPartial, ByIndex, Keyed, Keys, RouteSpec, Routed, Scatter, Unkeyed};
use crate::read::{AlsoRelated, KeyOf, ReadGuard, WithRelated};
use futures::future::BoxFuture;
use sea_orm::sea_query::JoinType;
use sea_orm::{
    FromQueryResult, IdenStatic, Order, PaginatorTrait, QuerySelect, Related, Select,
    SelectGetableTuple, SelectModel, Selector, SelectorTrait, TryGetableMany, Value,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A read of entity `E` through the cluster: a SeaORM [`Select`] plus routing.
///
/// `filter` works as on a `Select<E>` (it is pushed to every shard).
/// `order_by_asc`, `order_by_desc`, `order_by`, `limit` and `offset` are
/// shardkit's own, so a multi-shard read can merge them correctly. A
/// single-key read also takes every other [`QueryOrder`](sea_orm::QueryOrder) and [`QuerySelect`]
/// method; a read that selects only some columns (`select_only().column(..)`)
/// decodes with [`into_tuple`](Find::into_tuple),
/// [`into_model`](Find::into_model) or [`into_json`](Find::into_json), since
/// `all()` decodes whole `E::Model`s.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct Find<E: ShardedEntity, R = Unkeyed> {
    pub(super) shards: Shards,
    /// How `by_index` reads find keys (the global-index feature).
    pub(super) index: Option<Arc<dyn IndexLookup>>,
    /// What may refuse a read of `E` before it runs (a rollout that no
    /// longer writes `E`'s table).
    pub(super) guard: Option<Arc<dyn ReadGuard>>,
    /// Another entity the statement joins whose reads the guard decides
    /// too ([`Cluster::find_related`](crate::Cluster::find_related)'s model).
    pub(super) joined: Option<(std::any::TypeId, &'static str)>,
    pub(super) select: Select<E>,
    pub(super) route: R,
    pub(super) order: Vec<(E::Column, Order)>,
    pub(super) limit: Option<u64>,
    pub(super) offset: Option<u64>,
    pub(super) timeout: Option<Duration>,
    pub(super) concurrency: Option<usize>,
}

impl<E: ShardedEntity> Find<E, Unkeyed> {
    /// Makes the read's guard decide on `J` too, which its statement joins.
    pub(crate) fn joining<J: ShardedEntity>(mut self) -> Self {
        self.joined = Some((std::any::TypeId::of::<J>(), table_name::<J>()));
        self
    }

    pub(crate) fn new(
        shards: Shards,
        index: Option<Arc<dyn IndexLookup>>,
        guard: Option<Arc<dyn ReadGuard>>,
        select: Select<E>,
    ) -> Self {
        Find {
            shards,
            index,
            guard,
            joined: None,
            select,
            route: Unkeyed,
            order: Vec::new(),
            limit: None,
            offset: None,
            timeout: None,
            concurrency: None,
        }
    }

    fn reroute<R>(self, route: R) -> Find<E, R> {
        Find {
            shards: self.shards,
            index: self.index,
            guard: self.guard,
            joined: self.joined,
            select: self.select,
            route,
            order: self.order,
            limit: self.limit,
            offset: self.offset,
            timeout: self.timeout,
            concurrency: self.concurrency,
        }
    }

    /// Pins the read to one shard key: it runs on that key's shard only, with
    /// `shard_key = key` added to its `WHERE` clause.
    pub fn key(self, key: KeyOf<E>) -> Find<E, Keyed<KeyOf<E>>> {
        self.reroute(Keyed(key))
    }

    /// Reads several shard keys: each shard that holds some of them gets one
    /// query with only its own keys (`shard_key IN (...)`, chunked under the
    /// backend's parameter limit); the shards run concurrently.
    pub fn keys(self, keys: impl IntoIterator<Item = KeyOf<E>>) -> Find<E, Keys<KeyOf<E>>> {
        self.reroute(Keys(keys.into_iter().collect()))
    }

    /// Reads every shard of the group, on purpose.
    pub fn scatter(self) -> Find<E, Scatter> {
        self.reroute(Scatter)
    }

    /// Reads the rows whose `column` equals `value` through the column's
    /// global secondary index: the index names the shard keys, only their
    /// shards are asked, and each row is checked to hold the value (a
    /// dangling or stale index row never yields a wrong row). While the index
    /// is `write_only` this is a scatter read filtered by the column.
    pub fn by_index(self, column: E::Column, value: impl Into<Value>) -> Find<E, ByIndex> {
        self.reroute(ByIndex {
            column: column.as_str(),
            value: value.into(),
        })
    }
}

impl<E: ShardedEntity> Find<E, ByIndex> {
    /// Returns the rows of every healthy shard plus the failed shards
    /// ([`Partial`](crate::read::Partial)) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<ByIndex>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity> Find<E, Keys<KeyOf<E>>> {
    /// Returns the rows of every healthy shard plus the failed shards
    /// ([`Partial`](crate::read::Partial)) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<Keys<KeyOf<E>>>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity> Find<E, Scatter> {
    /// Returns the rows of every healthy shard plus the failed shards
    /// ([`Partial`](crate::read::Partial)) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<Scatter>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity, R> Find<E, R> {
    fn partial_inner(self) -> Find<E, AllowPartial<R>> {
        Find {
            shards: self.shards,
            index: self.index,
            guard: self.guard,
            joined: self.joined,
            select: self.select,
            route: AllowPartial(self.route),
            order: self.order,
            limit: self.limit,
            offset: self.offset,
            timeout: self.timeout,
            concurrency: self.concurrency,
        }
    }

    /// Orders by a column, ascending. Merged across shards.
    pub fn order_by_asc(self, column: E::Column) -> Self {
        self.order_by(column, Order::Asc)
    }

    /// Orders by a column, descending. Merged across shards.
    pub fn order_by_desc(self, column: E::Column) -> Self {
        self.order_by(column, Order::Desc)
    }

    /// Orders by a column. Merged across shards.
    pub fn order_by(mut self, column: E::Column, order: Order) -> Self {
        self.order.push((column, order));
        self
    }

    /// At most `limit` rows in all (each shard returns at most `limit +
    /// offset`; the merge keeps the global order).
    pub fn limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Skips the first `offset` rows of the merged result.
    pub fn offset(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    /// How long each shard may take before it counts as failed and its query is
    /// cancelled (overrides `read.timeout_ms`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// How many shards this read queries at once (overrides
    /// `read.max_concurrency`; at least 1).
    pub fn max_concurrency(mut self, shards: usize) -> Self {
        self.concurrency = Some(shards.max(1));
        self
    }

    async fn run_all(self) -> Result<R::Output<Vec<E::Model>>>
    where
        R: Routed<E>,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "all", |s, conn| s.all(conn))
                .await;
        }
        let (rows, gathered) = read.rows(plan, "all").await;
        R::finish(rows?, gathered)
    }

    async fn run_one(self) -> Result<R::Output<Option<E::Model>>>
    where
        R: Routed<E>,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::One).await?;
        if let Some((target, _)) = &plan.single {
            // A keyed read that finds nothing is counted (see `crate::metrics`).
            let shard = read.shards.shard_name(target.shard);
            return read
                .single::<R, _, _, _>(plan, "one", move |s, conn| {
                    let one = s.one(conn);
                    async move {
                        let row = one.await;
                        if let Ok(None) = &row {
                            crate::metrics::not_found(shard, table_name::<E>());
                        }
                        row
                    }
                })
                .await;
        }
        let (rows, gathered) = read.rows(plan, "one").await;
        R::finish(rows?.into_iter().next(), gathered)
    }

    async fn run_count(self) -> Result<R::Output<u64>>
    where
        R: Routed<E>,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::Count).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "count", |s, conn| s.count(conn))
                .await;
        }
        // A scatter of a movable group sums `COUNT(*)`s only when no move
        // of the group ran before or while they were taken; otherwise (a
        // moving row is on its source and its target) it counts whole
        // rows, each on the shard the plan's map says owns it.
        let scatters_movable = plan.owners.is_some();
        let before = read.move_mark(scatters_movable).await;
        let owners = plan.owners.as_ref();
        if before.is_some_and(|mark| !matches!(mark, Some((0, _)))) {
            let (n, gathered) = read
                .count_owned(plan.parts, plan.asked, plan.lookup_failed, owners)
                .await;
            return R::finish(n?, gathered);
        }
        let again = scatters_movable.then(|| plan.parts.clone());
        let asked = plan.asked;
        let (ok, mut failed, span) = read
            .gather(plan.parts, asked, "count", |s, conn| s.count(conn))
            .await;
        if let Some(parts) = again
            && read.move_mark(true).await != before
        {
            let (n, gathered) = read
                .count_owned(parts, asked, plan.lookup_failed, owners)
                .await;
            return R::finish(n?, gathered);
        }
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        let n: u64 = ok.into_iter().map(|(_, n)| n).sum();
        span.record("rows", n);
        R::finish(n, read.gathered(asked, failed))
    }

    async fn run_explain(self) -> Result<ReadPlan>
    where
        R: Routed<E>,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        Ok(read.describe(plan, R::PARTIAL))
    }

    /// The read's settings, its statement (moved, not copied: a keyed read
    /// sends it as is) and its route.
    fn split(self) -> (Read<E>, Box<Select<E>>, RouteSpec<KeyOf<E>>)
    where
        R: Routed<E>,
    {
        let settings = self.shards.read_settings();
        let read = Read {
            timeout: self.timeout.or(settings.timeout),
            concurrency: self.concurrency.unwrap_or(settings.max_concurrency),
            shards: self.shards,
            index: self.index,
            guard: self.guard,
            joined: self.joined,
            order: self.order,
            limit: self.limit,
            offset: self.offset,
        };
        // Boxed once: the statement then moves through planning as a
        // pointer and is changed in place.
        (read, Box::new(self.select), self.route.spec())
    }
}

/// The methods that run a read, on every route that names its shards.
///
/// They sit on one impl per route rather than on one generic impl with a
/// `Routed` bound, so that the unkeyed read's own methods (below) can say why
/// it does not run, in one error at the call instead of three (the call, its
/// future, and its `.await`). Each returns the executor's future itself: no
/// wrapping layer copies it.
macro_rules! routed_reads {
    ($($route:ty => [$($generics:tt)*]),* $(,)?) => {$(
        impl<E: ShardedEntity, $($generics)*> Find<E, $route>
        where
            $route: Routed<E>,
        {
            /// All matching rows.
            pub fn all(
                self,
            ) -> impl Future<Output = Result<<$route as Routed<E>>::Output<Vec<E::Model>>>> {
                self.run_all()
            }

            /// The first matching row (in `order_by` order across shards).
            pub fn one(
                self,
            ) -> impl Future<Output = Result<<$route as Routed<E>>::Output<Option<E::Model>>>> {
                self.run_one()
            }

            /// The number of matching rows (summed over shards;
            /// `limit`/`offset` and ordering do not apply).
            pub fn count(self) -> impl Future<Output = Result<<$route as Routed<E>>::Output<u64>>>
            {
                self.run_count()
            }

            /// What [`all`](Self::all) would do, without reading any row:
            /// the shards, the statement each would get, how their rows
            /// would merge, the failure policy and the timeout (like
            /// Vitess's `VEXPLAIN`). Routing lookups the read needs (a
            /// directory placement, a global index) do run: they are how the
            /// shards are chosen. Print it with `{}`.
            pub fn explain(self) -> impl Future<Output = Result<ReadPlan>> {
                self.run_explain()
            }
        }
    )*};
}

routed_reads! {
    Keyed<KeyOf<E>> => [],
    Keys<KeyOf<E>> => [],
    Scatter => [],
    ByIndex => [],
    AllowPartial<R> => [R],
}

/// An unkeyed read does not run: these exist only so that calling them is
/// one compile error saying what to add (the `Routed` bound cannot hold).
impl<E: ShardedEntity> Find<E, Unkeyed> {
    #[doc(hidden)]
    pub fn all(self) -> std::future::Pending<Result<Vec<E::Model>>>
    where
        Unkeyed: Routed<E>,
    {
        std::future::pending()
    }

    #[doc(hidden)]
    pub fn one(self) -> std::future::Pending<Result<Option<E::Model>>>
    where
        Unkeyed: Routed<E>,
    {
        std::future::pending()
    }

    #[doc(hidden)]
    pub fn count(self) -> std::future::Pending<Result<u64>>
    where
        Unkeyed: Routed<E>,
    {
        std::future::pending()
    }

    #[doc(hidden)]
    pub fn explain(self) -> std::future::Pending<Result<ReadPlan>>
    where
        Unkeyed: Routed<E>,
    {
        std::future::pending()
    }
}

impl<E: ShardedEntity, R: Clone> Clone for Find<E, R> {
    fn clone(&self) -> Self {
        Find {
            shards: self.shards.clone(),
            index: self.index.clone(),
            guard: self.guard.clone(),
            joined: self.joined,
            select: self.select.clone(),
            route: self.route.clone(),
            order: self.order.clone(),
            limit: self.limit,
            offset: self.offset,
            timeout: self.timeout,
            concurrency: self.concurrency,
        }
    }
}

impl<E: ShardedEntity> Find<E, Keyed<KeyOf<E>>> {
    /// Pages of `page_size` rows (at least 1), like SeaORM's
    /// [`PaginatorTrait::paginate`]: each page is a keyed read on the key's
    /// shard (`LIMIT`/`OFFSET` after this read's ordering), so order the read
    /// for pages to be stable.
    pub fn paginate(self, page_size: u64) -> KeyedPages<E> {
        KeyedPages {
            find: self,
            page_size: Ord::max(page_size, 1),
        }
    }

    /// Each row of the key with its related rows of `R`, as SeaORM's
    /// [`Select::find_with_related`]: `R` is an entity of the same group,
    /// joined along `E`'s relation with its side scoped to the key in the
    /// join's `ON` clause, so another key's rows on the same shard are never
    /// related (and never hide a row of this key). One statement on the key's
    /// shard. A many-to-many relation's junction table is joined as the
    /// relation says, not scoped: keep junction rows' foreign keys unique
    /// across keys. `limit`/`offset` are refused
    /// ([`ShardError::Unsupported`]): they would count joined rows.
    pub fn find_with_related<R>(self, _related: R) -> BoxFuture<'static, Result<WithRelated<E, R>>>
    where
        R: InGroup<E::Group>,
        E: Related<R>,
    {
        boxed(move || async move {
            if self.limit.is_some() || self.offset.is_some() {
                return Err(ShardError::Unsupported {
                    table: table_name::<E>(),
                    operation: "find_with_related",
                    reason:
                        "`limit` and `offset` would count joined rows, cutting a row's related \
                             rows short: page the rows in a read of their own and read each one's \
                             related rows with `find_related`"
                            .to_owned(),
                });
            }
            let key = self.route.0.clone();
            let (read, select, spec) = self.split();
            let r_from = guard_check::<R>(read.guard.as_deref())?;
            let plan = read.plan(select, spec, ReadOp::All).await?;
            read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "all", move |s, conn| {
                let backend = conn.get_database_backend();
                join_related::<E, R>(s, JoinType::LeftJoin, &key, backend, r_from.as_ref())
                    .select_with(R::default())
                    .all(conn)
            })
            .await
        })
    }

    /// Each row of the key with its related row of `R`, if any, as SeaORM's
    /// [`Select::find_also_related`]; the related side scoped to the key in
    /// the join, as in [`find_with_related`](Self::find_with_related).
    pub fn find_also_related<R>(self, _related: R) -> BoxFuture<'static, Result<AlsoRelated<E, R>>>
    where
        R: InGroup<E::Group>,
        E: Related<R>,
    {
        boxed(move || async move {
            let key = self.route.0.clone();
            let (read, select, spec) = self.split();
            let r_from = guard_check::<R>(read.guard.as_deref())?;
            let plan = read.plan(select, spec, ReadOp::All).await?;
            read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "all", move |s, conn| {
                let backend = conn.get_database_backend();
                join_related::<E, R>(s, JoinType::LeftJoin, &key, backend, r_from.as_ref())
                    .select_also(R::default())
                    .all(conn)
            })
            .await
        })
    }

    /// The rows of the key as a stream, like SeaORM's [`Select::stream`]:
    /// rows are decoded as the shard sends them, so a large key's rows need
    /// not fit in memory. The statement has started (and its first row
    /// arrived, or its error) when this returns; each later row is awaited
    /// under the read's timeout and the shard's breaker. The stream holds one
    /// of the shard's pooled connections until it ends or is dropped.
    pub async fn stream(self) -> Result<RowStream<'static, E::Model>> {
        self.into_stream(|s| s.into_model::<E::Model>()).await
    }

    /// Decodes each row into `M` instead of `E::Model`, as SeaORM's
    /// [`Select::into_model`] does: for `select_only().column(..)` reads and
    /// partial models. The read stays on the key's shard, scoped to the key.
    pub fn into_model<M: FromQueryResult>(self) -> KeyedSelect<E, SelectModel<M>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_model::<M>(),
        }
    }

    /// Decodes each row into a tuple of its selected columns, as SeaORM's
    /// [`Select::into_tuple`] does (`select_only().column(a).column(b)` →
    /// `(A, B)`).
    pub fn into_tuple<T: TryGetableMany>(self) -> KeyedSelect<E, SelectGetableTuple<T>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_tuple::<T>(),
        }
    }

    /// Decodes each row into a JSON object, as SeaORM's [`Select::into_json`].
    pub fn into_json(self) -> KeyedSelect<E, SelectModel<sea_orm::JsonValue>> {
        KeyedSelect {
            find: self,
            into: |select| select.into_json(),
        }
    }
}

impl<E: ShardedEntity> Find<E, Keyed<KeyOf<E>>> {
    async fn into_stream<S>(
        self,
        into: fn(Select<E>) -> Selector<S>,
    ) -> Result<RowStream<'static, S::Item>>
    where
        S: SelectorTrait + Send + 'static,
        S::Item: Send + 'static,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        read.stream(plan, into).await
    }
}

/// The rows of a streamed read ([`Find::stream`], [`KeyedSelect::stream`],
/// [`TxFind::stream`](crate::read::TxFind::stream)): SeaORM's `PinBoxStream` with shardkit's errors.
pub type RowStream<'a, T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T>> + Send + 'a>>;

/// The routes that read several shards: [`Keys`], [`Scatter`], [`ByIndex`]
/// and their [`AllowPartial`] forms.
pub trait MultiShard: sealed_multi::Sealed {}
impl<K> MultiShard for Keys<K> {}
impl MultiShard for Scatter {}
impl MultiShard for ByIndex {}
impl<R: MultiShard> MultiShard for AllowPartial<R> {}

mod sealed_multi {
    pub trait Sealed {}
    impl<K> Sealed for super::Keys<K> {}
    impl Sealed for super::Scatter {}
    impl Sealed for super::ByIndex {}
    impl<R: Sealed> Sealed for super::AllowPartial<R> {}
}

/// Projections of a multi-shard read. Rows of several shards are one
/// result when nothing orders them: they come shard by shard, and `limit`
/// and `offset` apply to the whole (each shard returns at most `limit +
/// offset`). `order_by` needs the order columns of whole rows to merge, so
/// an ordered projection is refused before any I/O with
/// [`ShardError::Unmergeable`]; read whole rows with `all()` instead.
impl<E: ShardedEntity, R: MultiShard + Routed<E>> Find<E, R> {
    /// Selects no column yet (SeaORM's `QuerySelect::select_only`); add
    /// them with [`column`](Self::column).
    pub fn select_only(mut self) -> Self {
        self.select = QuerySelect::select_only(self.select);
        self
    }

    /// Selects one column (SeaORM's `QuerySelect::column`).
    pub fn column(mut self, column: E::Column) -> Self {
        self.select = QuerySelect::column(self.select, column);
        self
    }

    /// Decodes each row into `M` (SeaORM's [`Select::into_model`]).
    pub fn into_model<M: FromQueryResult>(self) -> MultiSelect<E, R, SelectModel<M>> {
        MultiSelect {
            find: self,
            into: |select| select.into_model::<M>(),
        }
    }

    /// Decodes each row into a tuple of its selected columns (SeaORM's
    /// [`Select::into_tuple`]).
    pub fn into_tuple<T: TryGetableMany>(self) -> MultiSelect<E, R, SelectGetableTuple<T>> {
        MultiSelect {
            find: self,
            into: |select| select.into_tuple::<T>(),
        }
    }

    /// Decodes each row into a JSON object (SeaORM's [`Select::into_json`]).
    pub fn into_json(self) -> MultiSelect<E, R, SelectModel<sea_orm::JsonValue>> {
        MultiSelect {
            find: self,
            into: |select| select.into_json(),
        }
    }
}

/// A multi-shard read decoded into another shape ([`Find::into_tuple`] and
/// friends on [`Keys`], [`Scatter`] and [`ByIndex`] reads).
#[must_use = "a read does nothing until `.all()` runs it"]
pub struct MultiSelect<E: ShardedEntity, R, S: SelectorTrait> {
    find: Find<E, R>,
    into: fn(Select<E>) -> Selector<S>,
}

impl<E: ShardedEntity, R: MultiShard + Routed<E>, S: SelectorTrait> MultiSelect<E, R, S>
where
    S::Item: Send,
{
    /// Every matching row of every shard asked, shard by shard.
    pub async fn all(self) -> Result<R::Output<Vec<S::Item>>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        if let Some((column, _)) = read.order.first() {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!(
                    "a projection of several shards ordered by `{}`: shards are merged by the \
                     order columns of whole rows; read whole rows with `all()`, or project each \
                     key's rows with a keyed read",
                    column.as_str()
                ),
            });
        }
        let plan = read.plan(select, spec, ReadOp::All).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "all", |s, conn| into(s).all(conn))
                .await;
        }
        // A scatter of a movable group projects only when no move of the
        // group ran before or while it read: a moving row is on two shards
        // and a projection keeps no key to tell the copies apart.
        let scatters_movable = plan.owners.is_some();
        let before = read.move_mark(scatters_movable).await;
        if let Some(mark) = before
            && !matches!(mark, Some((0, _)))
        {
            return Err(moving_projection::<E>(mark.is_some()));
        }
        let asked = plan.asked;
        let (mut ok, mut failed, span) = read
            .gather(plan.parts, asked, "all", |s, conn| into(s).all(conn))
            .await;
        if scatters_movable && read.move_mark(true).await != before {
            return Err(moving_projection::<E>(true));
        }
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        ok.sort_by_key(|(id, _)| *id);
        let rows: Vec<S::Item> = ok
            .into_iter()
            .flat_map(|(_, rows)| rows)
            .skip(plan.offset as usize)
            .take(plan.limit.map_or(usize::MAX, |l| l as usize))
            .collect();
        span.record("rows", rows.len());
        R::finish(rows, read.gathered(asked, failed))
    }
}

/// The pages of a keyed read ([`Find::paginate`]).
#[must_use = "pages are read by `fetch_page`, `num_items` or `num_pages`"]
pub struct KeyedPages<E: ShardedEntity> {
    find: Find<E, Keyed<KeyOf<E>>>,
    page_size: u64,
}

impl<E: ShardedEntity> KeyedPages<E> {
    /// Page `page` (from 0): at most `page_size` rows.
    pub async fn fetch_page(&self, page: u64) -> Result<Vec<E::Model>> {
        let mut find = self.find.clone();
        find.limit = Some(self.page_size);
        find.offset = Some(page.saturating_mul(self.page_size));
        find.all().await
    }

    /// How many rows the read has (within its key).
    pub async fn num_items(&self) -> Result<u64> {
        let mut find = self.find.clone();
        find.limit = None;
        find.offset = None;
        find.count().await
    }

    /// How many pages those rows fill.
    pub async fn num_pages(&self) -> Result<u64> {
        Ok(self.num_items().await?.div_ceil(self.page_size))
    }

    /// The rows per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
}

/// A keyed read decoded into another shape ([`Find::into_model`],
/// [`Find::into_tuple`], [`Find::into_json`]). Runs like the keyed read it
/// came from: the key's shard, the key's predicate, the read's timeout.
#[must_use = "a read does nothing until `.all()` or `.one()` runs it"]
pub struct KeyedSelect<E: ShardedEntity, S: SelectorTrait> {
    pub(super) find: Find<E, Keyed<KeyOf<E>>>,
    pub(super) into: fn(Select<E>) -> Selector<S>,
}

impl<E: ShardedEntity, S: SelectorTrait> KeyedSelect<E, S> {
    /// All matching rows of the key.
    pub async fn all(self) -> Result<Vec<S::Item>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        let plan = read.plan(select, spec, ReadOp::All).await?;
        read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "all", |s, conn| into(s).all(conn))
            .await
    }

    /// The rows of the key as a stream (see [`Find::stream`]).
    pub async fn stream(self) -> Result<RowStream<'static, S::Item>>
    where
        S: Send + 'static,
        S::Item: Send + 'static,
    {
        self.find.into_stream(self.into).await
    }

    /// The first matching row of the key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        let plan = read.plan(select, spec, ReadOp::One).await?;
        read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "one", |s, conn| into(s).one(conn))
            .await
    }
}

/// The refusal of a projection of several shards of a `movable` group
/// while a move of it runs (`known`), or while its control database
/// cannot say whether one does.
fn moving_projection<E: ShardedEntity>(known: bool) -> ShardError {
    let group = <E::Group as EntityGroup>::NAME;
    let why = if known {
        format!("a move of group `{group}` is not finished (or started while the read ran)")
    } else {
        format!("the control database of group `{group}` cannot say whether a move of it runs")
    };
    ShardError::Unmergeable {
        table: table_name::<E>(),
        reason: format!(
            "a projection of several shards while {why}: the moving buckets' rows are on two \
             shards until the move is cleaned, and a projection keeps no key to tell the copies \
             apart; read whole rows with `all()` (each is read once), project each key's rows \
             with a keyed read, or project after the move"
        ),
    }
}
