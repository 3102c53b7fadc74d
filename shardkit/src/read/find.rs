//! [`Find`], the read a user builds, and the single-key SeaORM selects.

use crate::boxed::boxed;
use crate::entity::{Joinable, ReferenceTable, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::{Consistency, Shards};
use crate::read::index::IndexLookup;
use crate::read::keys::{guard_check, join_related};
use crate::read::plan::{ReadOp, ReadPlan};
use crate::read::request::Read;
use crate::read::route::{AllowPartial, ByIndex, Keyed, Keys, RouteSpec, Routed, Scatter, Unkeyed};
use crate::read::{AlsoRelated, KeyOf, ReadGuard, WithRelated};
use futures::future::BoxFuture;
use sea_orm::sea_query::JoinType;
use sea_orm::{
    DatabaseConnection, DbErr, IdenStatic, Order, PaginatorTrait, Related, Select, Value,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A read of entity `E` through the cluster: a SeaORM [`Select`] plus routing.
///
/// `filter` works as on a `Select<E>` (it is pushed to every shard).
/// `order_by_asc`, `order_by_desc`, `order_by`, `limit` and `offset` are
/// shardkit's own, so a multi-shard read can merge them correctly. A
/// single-key read also takes every other [`QueryOrder`](sea_orm::QueryOrder) and [`QuerySelect`](sea_orm::QuerySelect)
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
    /// Boxed where the read is made: the builder methods and `split` move
    /// a `Find`, and the statement is most of its size.
    pub(super) select: Box<Select<E>>,
    pub(super) route: R,
    pub(super) order: Vec<(E::Column, Order)>,
    pub(super) limit: Option<u64>,
    pub(super) offset: Option<u64>,
    pub(super) timeout: Option<Duration>,
    pub(super) concurrency: Option<usize>,
    /// Which database may answer ([`Consistency::Primary`] by default).
    pub(super) consistency: Consistency,
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
            select: Box::new(select),
            route: Unkeyed,
            order: Vec::new(),
            limit: None,
            offset: None,
            timeout: None,
            concurrency: None,
            consistency: Consistency::Primary,
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
            consistency: self.consistency,
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
            consistency: self.consistency,
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
    /// cancelled (overrides `read.timeout_ms`). A read a replica may answer
    /// gives the replica at most half of it (the session's wait and the
    /// replica's answer) and the shard the rest; a stream's first row is
    /// within it, each later row gets all of it.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Which database may answer this read: the shard itself (the
    /// default), any replica within a lag bound, or a replica that has
    /// replayed past a session's writes (see [`Consistency`]). A read that
    /// a replica cannot serve is answered by the shard itself; a replica
    /// that fails or does not answer within `[read] replica_timeout_ms`
    /// leaves the rotation and the shard answers (one that the read's own
    /// [`timeout`](Self::timeout) cut shorter stays in it). A replica answers a read
    /// of a `movable` group only once it has replayed past the last bucket
    /// move this instance has seen (see `shardkit::guide::replicas`).
    /// Transactions always read their own shard.
    pub fn consistency(mut self, consistency: Consistency) -> Self {
        self.consistency = consistency;
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
                .single::<R, _, _, _>(plan, "all", crate::exec::statements::all_models)
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
                    let one = crate::exec::statements::one_model(s, conn);
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
        // (Boxed where taken: a keyed read's future stays small.)
        let (rows, gathered) = Box::pin(read.rows(plan, "one")).await;
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
    pub(super) fn split(self) -> (Read<E>, Box<Select<E>>, RouteSpec<KeyOf<E>>)
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
            consistency: self.consistency,
        };
        // The statement moves through planning as a pointer and is changed
        // in place.
        (read, self.select, self.route.spec())
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
            consistency: self.consistency.clone(),
        }
    }
}

impl<E: ShardedEntity> Find<E, Keyed<KeyOf<E>>> {
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
        R: Joinable<E::Group>,
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
            self.joined::<R, _>(|select, conn| Box::pin(select.select_with(R::default()).all(conn)))
                .await
        })
    }

    /// Each row of the key with its related row of `R`, if any, as SeaORM's
    /// [`Select::find_also_related`]; the related side scoped to the key in
    /// the join, as in [`find_with_related`](Self::find_with_related).
    pub fn find_also_related<R>(self, _related: R) -> BoxFuture<'static, Result<AlsoRelated<E, R>>>
    where
        R: Joinable<E::Group>,
        E: Related<R>,
    {
        boxed(move || {
            self.joined::<R, _>(|select, conn| Box::pin(select.select_also(R::default()).all(conn)))
        })
    }

    /// The key's rows of `E` left-joined with `R` along `E`'s relation, `R`'s
    /// side scoped to the key, read by `read` (SeaORM's `select_with` or
    /// `select_also` and `all`) on the key's shard, inside `R`'s fence when
    /// `R` is a reference table.
    async fn joined<R, T>(
        self,
        read: impl for<'c> Fn(
            Select<E>,
            &'c DatabaseConnection,
        ) -> BoxFuture<'c, std::result::Result<T, DbErr>>,
    ) -> Result<T>
    where
        R: Joinable<E::Group>,
        E: Related<R>,
        T: Default,
    {
        let key = self.route.0.clone();
        let (request, select, spec) = self.split();
        let r_from = guard_check::<R>(request.guard.as_deref())?;
        let fence = R::__REFERENCE.zip(request.guard.clone());
        let refused = FenceRefusal::default();
        let plan = request.plan(select, spec, ReadOp::All).await?;
        let outcome = request
            .single::<Keyed<KeyOf<E>>, _, _, _>(plan, "all", |s, conn| {
                let backend = conn.get_database_backend();
                let select =
                    join_related::<E, R>(s, JoinType::LeftJoin, &key, backend, r_from.as_ref());
                fenced(fence.clone(), &refused, conn, read(select, conn))
            })
            .await;
        fence_error(&refused, outcome)
    }
}

/// Runs `read` on `conn` inside a reference table's fence when the read
/// joins one (see [`ReferenceFence`](crate::read::guard::ReferenceFence)).
/// The read's statement future answers with a database error; the fence's
/// own error (a copy behind, a catch-up that could not run) is left in
/// `refused` for [`fence_error`], with its text as that database error.
async fn fenced<T>(
    fence: Option<(&'static dyn ReferenceTable, Arc<dyn ReadGuard>)>,
    refused: &FenceRefusal,
    conn: &DatabaseConnection,
    read: impl std::future::Future<Output = std::result::Result<T, DbErr>>,
) -> std::result::Result<T, DbErr> {
    let fence = fence
        .as_ref()
        .and_then(|(table, guard)| guard.reference_fence().map(|f| (*table, f)));
    let refuse = |e: ShardError| {
        let text = e.report().to_string();
        *refused.lock().unwrap_or_else(|p| p.into_inner()) = Some((text.clone(), e));
        DbErr::Custom(text)
    };
    let need = match fence {
        Some((table, f)) => f.before(table, conn).await.map_err(refuse)?,
        None => 0,
    };
    let rows = read.await?;
    if let Some((table, f)) = fence {
        f.after(table, conn, need).await.map_err(refuse)?;
    }
    Ok(rows)
}

/// Where [`fenced`] leaves the fence's last refusal of a read, with the
/// text it answered the statement future with.
type FenceRefusal = Arc<std::sync::Mutex<Option<(String, ShardError)>>>;

/// A fenced read's outcome, failing with the fence's own refusal when that
/// is what it failed with: a replica's refusal followed by the shard's own
/// failure (a timeout, the breaker) is the shard's failure.
fn fence_error<T>(refused: &FenceRefusal, outcome: Result<T>) -> Result<T> {
    let refusal = refused.lock().unwrap_or_else(|p| p.into_inner()).take();
    match (outcome, refusal) {
        (
            Err(ShardError::Db {
                source: DbErr::Custom(said),
                ..
            }),
            Some((text, refusal)),
        ) if said == text => Err(refusal),
        (outcome, _) => outcome,
    }
}
