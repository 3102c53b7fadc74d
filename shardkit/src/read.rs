//! Reads. A read names what it reads before it can run: one shard key
//! ([`Find::key`]), several ([`Find::keys`]), or every shard on purpose
//! ([`Find::scatter`]).
//!
//! A keyed read runs on its key's shard with `shard_key = key` added to its
//! `WHERE` clause, so it never returns another key's rows even when two keys
//! share a shard. A multi-shard read asks only the shards that can hold its
//! keys, each with only its own keys (an `IN` list split per shard and chunked
//! under the backend's parameter limit), runs the shards concurrently (at most
//! `read.max_concurrency` at once) and merges: `order_by_*` + `limit` /
//! `offset` give the same rows as one database would, `count()` sums.
//!
//! A shard that fails or does not answer within the timeout fails the whole
//! read ([`ShardError::ShardsFailed`] names every failed shard and why), unless
//! the caller asked for partial results with [`Find::partial`].

use crate::entity::{EntityGroup, KeyRef, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError, ShardFailure};
use crate::exec::Shards;
use crate::topology::{ShardId, Target};
use futures::StreamExt;
use sea_orm::sea_query::{Expr, SelectStatement};
use sea_orm::{Condition, ExprTrait, IntoSimpleExpr};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, FromQueryResult, IdenStatic, ModelTrait,
    Order, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, QueryTrait, Select,
    SelectGetableTuple, SelectModel, Selector, SelectorTrait, TryGetableMany, Value,
};
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::time::Duration;
use tracing::Instrument;

/// An index read's question (see [`IndexLookup`]).
pub(crate) struct IndexQuery {
    pub(crate) group: &'static str,
    /// The indexed entity's table.
    pub(crate) entity: &'static str,
    pub(crate) column: &'static str,
    pub(crate) unique: bool,
}

/// How a read finds the keys an indexed value lives under: planning's
/// index step. The global-index feature ([`crate::gsi`]) implements it, and
/// the cluster hands it to the reads it starts.
pub(crate) trait IndexLookup: Send + Sync {
    /// The index table the read consults (for its plan).
    fn table(&self, query: &IndexQuery) -> String;
    /// The shard holding the index rows of `text`.
    fn index_shard(&self, shards: &Shards, query: &IndexQuery, text: &str) -> Result<ShardId>;
    /// The shard keys (as [`ShardKey::to_directory_text`]) listed for
    /// `value`; `None` while the index is not active (the read scatters).
    fn lookup<'a>(
        &'a self,
        shards: &'a Shards,
        query: &'a IndexQuery,
        value: &'a Value,
    ) -> futures::future::BoxFuture<'a, Result<Option<Vec<String>>>>;
}

/// `column = value` as an index lookup's owner check: exact, byte for byte,
/// as index values are. On MySQL/MariaDB a text column's collation usually
/// ignores case and trailing spaces, so a text value is also compared as
/// `CAST(column AS BINARY)`; the plain comparison stays first so the
/// column's own index can still be used.
pub(crate) fn exact_eq(column: Expr, value: &Value, backend: DbBackend) -> Condition {
    let cond = Condition::all().add(column.clone().eq(value.clone()));
    if backend == DbBackend::MySql && matches!(value, Value::String(_) | Value::Char(_)) {
        cond.add(column.cast_as("BINARY").eq(value.clone()))
    } else {
        cond
    }
}

/// The shard key type of entity `E`.
pub type KeyOf<E> = <<E as ShardedEntity>::Group as EntityGroup>::Key;

/// A read that has no shard key yet: add `.key(k)`, `.keys(..)` or `.scatter()`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unkeyed;

/// A read pinned to one shard key.
#[derive(Clone, Debug)]
pub struct Keyed<K>(K);

/// A read of several shard keys.
#[derive(Clone, Debug)]
pub struct Keys<K>(Vec<K>);

/// A read of every shard of the group.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scatter;

/// A read by a global secondary index value ([`Find::by_index`]).
#[derive(Clone, Debug)]
pub struct ByIndex {
    column: &'static str,
    value: Value,
}

/// A multi-shard read that returns the rows of healthy shards plus the list
/// of failed ones ([`Partial`]) instead of failing.
#[derive(Clone, Debug)]
pub struct AllowPartial<R>(R);

/// The result of a [`Find::partial`] read: the rows every healthy shard
/// returned, and the shards that failed with their errors.
#[derive(Debug)]
pub struct Partial<T> {
    /// Rows (or the count) from the shards that answered.
    pub rows: T,
    /// The shards that failed or timed out, with why.
    pub failed: Vec<ShardFailure>,
}

impl<T> Partial<T> {
    /// Whether every shard answered.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// The names of the shards that failed, in shard order.
    pub fn failed_shards(&self) -> Vec<&str> {
        self.failed.iter().map(|f| f.shard.as_str()).collect()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Unkeyed {}
    impl<K> Sealed for super::Keyed<K> {}
    impl<K> Sealed for super::Keys<K> {}
    impl Sealed for super::Scatter {}
    impl Sealed for super::ByIndex {}
    impl<R> Sealed for super::AllowPartial<R> {}
}

/// Which shards a read goes to.
#[doc(hidden)]
#[derive(Debug)]
pub enum RouteSpec<K> {
    /// One key: its shard.
    One(K),
    /// These keys: their shards, each with its own keys.
    Many(Vec<K>),
    /// Every shard of the group.
    All,
    /// The shards a global index lists for a value (column, value).
    Index(&'static str, Value),
}

/// What a multi-shard read tells [`Routed::finish`].
#[doc(hidden)]
#[derive(Debug)]
pub struct Gathered {
    group: &'static str,
    table: &'static str,
    asked: usize,
    failed: Vec<ShardFailure>,
}

/// The routing states a read can run in. `Unkeyed` is not one of them, so an
/// unkeyed read does not compile.
#[diagnostic::on_unimplemented(
    message = "this shardkit read has no shard key, so it cannot run",
    label = "add `.key(k)`, `.keys(..)` or `.scatter()` before running the read",
    note = "shardkit never guesses which shards to read: use `.key(k)` for one shard key, \
            `.keys([..])` for several, or `.scatter()` to read every shard on purpose"
)]
pub trait Routed<E: ShardedEntity>: sealed::Sealed + Send {
    /// What the read returns: the rows, or [`Partial`] rows.
    type Output<T>;
    #[doc(hidden)]
    const PARTIAL: bool = false;
    #[doc(hidden)]
    fn spec(self) -> RouteSpec<KeyOf<E>>;
    #[doc(hidden)]
    fn finish<T>(rows: T, gathered: Gathered) -> Result<Self::Output<T>>;
}

fn strict<T>(rows: T, gathered: Gathered) -> Result<T> {
    if gathered.failed.is_empty() {
        Ok(rows)
    } else {
        Err(ShardError::ShardsFailed {
            group: gathered.group,
            table: gathered.table,
            asked: gathered.asked,
            failures: gathered.failed,
        })
    }
}

impl<E: ShardedEntity> Routed<E> for Keyed<KeyOf<E>> {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::One(self.0)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for Keys<KeyOf<E>> {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::Many(self.0)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for Scatter {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::All
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity> Routed<E> for ByIndex {
    type Output<T> = T;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        RouteSpec::Index(self.column, self.value)
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<T> {
        strict(rows, gathered)
    }
}

impl<E: ShardedEntity, R: Routed<E>> Routed<E> for AllowPartial<R> {
    type Output<T> = Partial<T>;
    const PARTIAL: bool = true;
    fn spec(self) -> RouteSpec<KeyOf<E>> {
        self.0.spec()
    }
    fn finish<T>(rows: T, gathered: Gathered) -> Result<Partial<T>> {
        Ok(Partial {
            rows,
            failed: gathered.failed,
        })
    }
}

/// A read of entity `E` through the cluster: a SeaORM [`Select`] plus routing.
///
/// `filter` works as on a `Select<E>` (it is pushed to every shard).
/// `order_by_asc`, `order_by_desc`, `order_by`, `limit` and `offset` are
/// shardkit's own, so a multi-shard read can merge them correctly. A
/// single-key read also takes every other [`QueryOrder`] and [`QuerySelect`]
/// method; a read that selects only some columns (`select_only().column(..)`)
/// decodes with [`into_tuple`](Find::into_tuple),
/// [`into_model`](Find::into_model) or [`into_json`](Find::into_json), since
/// `all()` decodes whole `E::Model`s.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct Find<E: ShardedEntity, R = Unkeyed> {
    shards: Shards,
    /// How `by_index` reads find keys (the global-index feature).
    index: Option<Arc<dyn IndexLookup>>,
    select: Select<E>,
    route: R,
    order: Vec<(E::Column, Order)>,
    limit: Option<u64>,
    offset: Option<u64>,
    timeout: Option<Duration>,
    concurrency: Option<usize>,
}

impl<E: ShardedEntity> Find<E, Unkeyed> {
    pub(crate) fn new(
        shards: Shards,
        index: Option<Arc<dyn IndexLookup>>,
        select: Select<E>,
    ) -> Self {
        Find {
            shards,
            index,
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
    /// ([`Partial`]) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<ByIndex>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity> Find<E, Keys<KeyOf<E>>> {
    /// Returns the rows of every healthy shard plus the failed shards
    /// ([`Partial`]) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<Keys<KeyOf<E>>>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity> Find<E, Scatter> {
    /// Returns the rows of every healthy shard plus the failed shards
    /// ([`Partial`]) instead of failing the read.
    pub fn partial(self) -> Find<E, AllowPartial<Scatter>> {
        self.partial_inner()
    }
}

impl<E: ShardedEntity, R> Find<E, R> {
    fn partial_inner(self) -> Find<E, AllowPartial<R>> {
        Find {
            shards: self.shards,
            index: self.index,
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

    /// All matching rows.
    ///
    /// The `Routed` bound sits on each method rather than on the impl so that
    /// an unkeyed read reports the bound's own message, not "method not found".
    pub async fn all(self) -> Result<R::Output<Vec<E::Model>>>
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

    /// The first matching row (in `order_by` order across shards).
    pub async fn one(self) -> Result<R::Output<Option<E::Model>>>
    where
        R: Routed<E>,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::One).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "one", |s, conn| s.one(conn))
                .await;
        }
        let (rows, gathered) = read.rows(plan, "one").await;
        R::finish(rows?.into_iter().next(), gathered)
    }

    /// The number of matching rows (summed over shards; `limit`/`offset` and
    /// ordering do not apply).
    pub async fn count(self) -> Result<R::Output<u64>>
    where
        R: Routed<E>,
        E::Model: Sync,
    {
        let (read, select, spec) = self.split();
        let plan = read.plan(select, spec, ReadOp::Count).await?;
        if plan.single.is_some() {
            return read
                .single::<R, _, _, _>(plan, "count", |s, conn| s.count(conn))
                .await;
        }
        let asked = plan.asked;
        let (ok, mut failed, span) = read
            .gather(plan.parts, asked, "count", |s, conn| s.count(conn))
            .await;
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        let n: u64 = ok.into_iter().map(|(_, n)| n).sum();
        span.record("rows", n);
        R::finish(n, read.gathered(asked, failed))
    }

    /// What [`all`](Self::all) would do, without reading any row: the
    /// shards, the statement each would get, how their rows would merge,
    /// the failure policy and the timeout (like Vitess's `VEXPLAIN`). Routing
    /// lookups the read needs (a directory placement, a global index) do run:
    /// they are how the shards are chosen. Print it with `{}`.
    pub async fn explain(self) -> Result<ReadPlan>
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
            order: self.order,
            limit: self.limit,
            offset: self.offset,
        };
        // Boxed once: the statement then moves through planning as a
        // pointer and is changed in place.
        (read, Box::new(self.select), self.route.spec())
    }
}

/// Which statement shape a read runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadOp {
    All,
    One,
    Count,
}

/// A read planned before any of its statements runs: the shards, each
/// one's statement (already shaped), and what the merge applies.
struct Plan<E: ShardedEntity> {
    /// One key's shard and its statement, when it answers as is (no merge).
    single: Option<(Target, Box<Select<E>>)>,
    /// The statements of a multi-shard read, per shard (several per shard
    /// when a key list is chunked under the parameter limit).
    parts: Vec<(ShardId, Select<E>)>,
    /// Distinct shards asked.
    asked: usize,
    /// How the route was chosen, for [`ReadPlan`].
    route: PlannedRoute,
    /// Whether the route came from a global index (a failure of the one
    /// owner shard is then reported like a multi-shard read's).
    indexed: bool,
    /// The merged result's limit and offset.
    limit: Option<u64>,
    offset: u64,
    /// The index lookup's failure, when the read scatters without the
    /// index (reported beside the shards' own failures).
    lookup_failed: Option<ShardFailure>,
}

/// What a read will do, computed before any of its statements runs
/// ([`Find::explain`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadPlan {
    /// The entity group.
    pub group: &'static str,
    /// The table read.
    pub table: &'static str,
    /// How the shards were chosen.
    pub route: PlannedRoute,
    /// Every statement, with the shard it runs on, in shard order.
    pub statements: Vec<PlannedStatement>,
    /// How the shards' rows combine; `None` when one key's shard answers
    /// with the statement as written.
    pub merge: Option<MergePlan>,
    /// Whether a failed shard is reported beside the rows (`.partial()`)
    /// instead of failing the read.
    pub partial: bool,
    /// How long each shard may take.
    pub timeout: Option<Duration>,
    /// How many shards are asked at once.
    pub max_concurrency: usize,
}

/// How a [`ReadPlan`] chose its shards.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlannedRoute {
    /// One shard key (`.key(k)`), in `bucket` when the placement hashes.
    Key {
        /// The key's bucket.
        bucket: Option<u32>,
    },
    /// Several shard keys (`.keys(..)`), distinct ones counted.
    Keys {
        /// Distinct keys.
        keys: usize,
    },
    /// Every shard of the group (`.scatter()`).
    Scatter,
    /// A global index (`.by_index(..)`).
    Index {
        /// The index table consulted.
        index: String,
        /// The shard keys it listed; `None` while the index is `write_only`
        /// (the read scatters).
        keys: Option<usize>,
    },
}

/// One statement of a [`ReadPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedStatement {
    /// The shard it runs on.
    pub shard: String,
    /// The SQL, with its values inlined for reading (it is sent with bound
    /// parameters).
    pub sql: String,
}

/// How a multi-shard [`ReadPlan`] merges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergePlan {
    /// Columns the rows are merged by, and whether descending.
    pub order: Vec<(&'static str, bool)>,
    /// Rows kept after the offset.
    pub limit: Option<u64>,
    /// Rows skipped from the merged order.
    pub offset: u64,
}

impl std::fmt::Display for ReadPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "read {} (group {}) ", self.table, self.group)?;
        match &self.route {
            PlannedRoute::Key { bucket: Some(b) } => write!(f, "by key, bucket {b}")?,
            PlannedRoute::Key { bucket: None } => write!(f, "by key")?,
            PlannedRoute::Keys { keys } => write!(f, "by {keys} keys")?,
            PlannedRoute::Scatter => write!(f, "on every shard")?,
            PlannedRoute::Index {
                index,
                keys: Some(n),
            } => write!(f, "through index {index} ({n} keys)")?,
            PlannedRoute::Index { index, keys: None } => {
                write!(f, "through index {index} (write_only: every shard)")?
            }
        }
        let shards: std::collections::BTreeSet<&str> =
            self.statements.iter().map(|s| s.shard.as_str()).collect();
        write!(f, "; {} shard(s)", shards.len())?;
        match self.timeout {
            Some(t) => write!(f, ", timeout {} ms", t.as_millis())?,
            None => write!(f, ", no timeout")?,
        }
        write!(
            f,
            ", {} at once, {}",
            self.max_concurrency,
            if self.partial {
                "failed shards reported"
            } else {
                "any failed shard fails the read"
            }
        )?;
        for statement in &self.statements {
            write!(f, "\n  {}: {}", statement.shard, statement.sql)?;
        }
        if let Some(merge) = &self.merge {
            write!(f, "\n  merge")?;
            if merge.order.is_empty() {
                write!(f, " in shard order")?;
            }
            for (i, (column, desc)) in merge.order.iter().enumerate() {
                let sep = if i == 0 { " by" } else { "," };
                write!(f, "{sep} {column} {}", if *desc { "DESC" } else { "ASC" })?;
            }
            if merge.offset > 0 {
                write!(f, ", skip {}", merge.offset)?;
            }
            if let Some(limit) = merge.limit {
                write!(f, ", keep {limit}")?;
            }
        }
        Ok(())
    }
}

/// A read with its routing taken out: what every execution path shares.
struct Read<E: ShardedEntity> {
    shards: Shards,
    index: Option<Arc<dyn IndexLookup>>,
    order: Vec<(E::Column, Order)>,
    limit: Option<u64>,
    offset: Option<u64>,
    timeout: Option<Duration>,
    concurrency: usize,
}

impl<E: ShardedEntity> Read<E> {
    fn group() -> &'static str {
        <E::Group as EntityGroup>::NAME
    }

    fn gathered(&self, asked: usize, failed: Vec<ShardFailure>) -> Gathered {
        Gathered {
            group: Self::group(),
            table: table_name::<E>(),
            asked,
            failed,
        }
    }

    /// Plans the read: resolves an index route (once), routes the keys,
    /// builds and shapes each shard's statement. Fails before any I/O of the
    /// read itself when the ordering cannot be merged or a key cannot be
    /// routed.
    async fn plan(
        &self,
        select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
        op: ReadOp,
    ) -> Result<Plan<E>> {
        let (mut select, spec, index, lookup_failed) = match spec {
            RouteSpec::Index(..) => self.resolve_index(select, spec).await?,
            spec => (select, spec, None, None),
        };
        let indexed = index.is_some();
        let described = |route: PlannedRoute| match &index {
            Some((table, keys)) => PlannedRoute::Index {
                index: table.clone(),
                keys: *keys,
            },
            None => route,
        };
        let offset = self.offset.unwrap_or(0);
        if let RouteSpec::One(key) = &spec {
            // Hash, range and modulo placements route without I/O.
            let target = match self.shards.route_now::<E::Group>(key)? {
                Some(target) => target,
                None => self.shards.route::<E::Group>(key).await?,
            };
            tracing::debug!(key = ?key, shard = self.shards.shard_name(target.shard), "routed read");
            let backend = self.shards.shard_conn(target.shard).get_database_backend();
            add_key::<E>(&mut select, key, backend);
            // One key's shard answers the statement as written.
            if op != ReadOp::Count {
                self.shape(&mut select, self.limit, true);
            }
            return Ok(Plan {
                single: Some((target, select)),
                parts: Vec::new(),
                asked: 1,
                route: described(PlannedRoute::Key {
                    bucket: target.bucket,
                }),
                indexed,
                limit: self.limit,
                offset,
                lookup_failed: None,
            });
        }
        self.check_mergeable()?;
        let route = described(match &spec {
            RouteSpec::Many(keys) => PlannedRoute::Keys { keys: keys.len() },
            _ => PlannedRoute::Scatter,
        });
        let mut parts = self.fan_out(*select, spec).await?;
        if let Some(failed) = &lookup_failed {
            // The shard whose index lookup failed is not asked again.
            parts.retain(|(id, _)| self.shards.shard_name(*id) != failed.shard);
        }
        let limit = match op {
            ReadOp::One => Some(1),
            _ => self.limit,
        };
        if op != ReadOp::Count {
            for (_, select) in &mut parts {
                self.shape(select, limit, false);
            }
        }
        Ok(Plan {
            single: None,
            asked: count_shards(&parts),
            parts,
            route,
            indexed,
            limit,
            offset,
            lookup_failed,
        })
    }

    /// The printable form of a plan.
    fn describe(&self, plan: Plan<E>, partial: bool) -> ReadPlan {
        let single = plan
            .single
            .as_ref()
            .map(|(target, select)| (target.shard, &**select));
        let statements = single
            .into_iter()
            .chain(plan.parts.iter().map(|(id, select)| (*id, select)))
            .map(|(id, select)| PlannedStatement {
                shard: self.shards.shard_name(id).to_owned(),
                sql: self
                    .shards
                    .shard_conn(id)
                    .get_database_backend()
                    .build(QueryTrait::as_query(select))
                    .to_string(),
            })
            .collect();
        let merge = plan.single.is_none().then(|| MergePlan {
            order: self
                .order
                .iter()
                .map(|(c, o)| (c.as_str(), matches!(o, Order::Desc)))
                .collect(),
            limit: plan.limit,
            offset: plan.offset,
        });
        ReadPlan {
            group: Self::group(),
            table: table_name::<E>(),
            route: plan.route,
            statements,
            merge,
            partial,
            timeout: self.timeout,
            max_concurrency: self.concurrency,
        }
    }

    /// Runs a plan whose one key's shard answers as is. When the key came
    /// from an index, a failure is reported as a multi-shard read reports it
    /// (strict: `ShardsFailed`; `.partial()`: listed in `failed`), the same
    /// as when the index lists several keys.
    async fn single<'a, R, T, F, Fut>(
        &'a self,
        mut plan: Plan<E>,
        op: &'static str,
        run: F,
    ) -> Result<R::Output<T>>
    where
        R: Routed<E>,
        T: Default,
        F: FnOnce(Select<E>, &'a DatabaseConnection) -> Fut,
        Fut: Future<Output = std::result::Result<T, DbErr>>,
    {
        let Some((target, select)) = plan.single.take() else {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: "internal: a multi-shard plan run as a single-shard one".to_owned(),
            });
        };
        let shard = self.shards.shard_name(target.shard);
        let span = read_span::<E>(shard, target.bucket, op);
        let conn = self.shards.shard_conn(target.shard);
        let fut = crate::trace::in_span(span, run(*select, conn));
        let fut = async { fut.await.map_err(|e| read_err::<E>(shard, e)) };
        match self
            .shards
            .bounded(target.shard, Self::group(), self.timeout, fut)
            .await
        {
            Ok(value) => R::finish(value, self.gathered(1, Vec::new())),
            Err(error) if plan.indexed => {
                let failure = ShardFailure {
                    shard: shard.to_owned(),
                    error: Box::new(error),
                };
                R::finish(T::default(), self.gathered(1, vec![failure]))
            }
            Err(error) => Err(error),
        }
    }

    /// Runs a multi-shard plan of rows: gather, merge.
    async fn rows(&self, plan: Plan<E>, op: &'static str) -> (Result<Vec<E::Model>>, Gathered) {
        let asked = plan.asked;
        let (ok, mut failed, span) = self
            .gather(plan.parts, asked, op, |s, conn| s.all(conn))
            .await;
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        let rows = self.merge(ok, plan.limit, plan.offset);
        if let Ok(rows) = &rows {
            span.record("rows", rows.len());
        }
        (rows, self.gathered(asked, failed))
    }

    /// Applies ordering and paging. A single shard gets them as written; a
    /// shard of a multi-shard read returns its first `limit + offset` rows and
    /// the merge applies the offset.
    fn shape(&self, select: &mut Select<E>, limit: Option<u64>, single: bool) {
        let query = QueryTrait::query(select);
        for (column, order) in &self.order {
            query.order_by_expr(column.into_simple_expr(), order.clone());
        }
        let offset = self.offset.unwrap_or(0);
        match (limit, single) {
            (Some(limit), true) => {
                query.limit(limit);
            }
            (Some(limit), false) => {
                query.limit(limit.saturating_add(offset));
            }
            (None, _) => {}
        }
        if single && offset > 0 {
            query.offset(offset);
        }
    }

    /// Resolves an index read into the keys the index lists (one key takes
    /// the single-shard path) or, while the index fills, a scatter; either
    /// way the statement also filters on the indexed column, so a dangling or
    /// stale index row never yields a wrong row. Other routes pass through.
    /// Returns the index table consulted and how many keys it listed.
    async fn resolve_index(
        &self,
        mut select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
    ) -> Result<(
        Box<Select<E>>,
        RouteSpec<KeyOf<E>>,
        Option<(String, Option<usize>)>,
        Option<ShardFailure>,
    )> {
        Ok(match spec {
            RouteSpec::Index(column, value) => {
                // Whatever the index finds, ordering follows multi-shard rules.
                self.check_mergeable()?;
                let (col, unique) = E::GLOBAL_INDEXES
                    .iter()
                    .find(|(c, _)| c.as_str() == column)
                    .ok_or_else(|| {
                        ShardError::config(
                            format!("{}.{column}", table_name::<E>()),
                            "no global index on this column: add `#[shardkit(global_index)]` to the field",
                        )
                    })?;
                let lookup = self.index.as_ref().ok_or_else(|| {
                    ShardError::config(
                        format!("{}.{column}", table_name::<E>()),
                        "index reads need the cluster's global-index service: start them with `cluster.find()`",
                    )
                })?;
                let query = IndexQuery {
                    group: Self::group(),
                    entity: table_name::<E>(),
                    column: col.as_str(),
                    unique: *unique,
                };
                let index_table = lookup.table(&query);
                let backend = self
                    .shards
                    .topology()
                    .shards_of(Self::group())?
                    .first()
                    .map_or(DbBackend::Postgres, |id| {
                        self.shards.shard_conn(*id).get_database_backend()
                    });
                QueryTrait::query(&mut *select).cond_where(exact_eq(
                    Expr::col((E::default(), *col)),
                    &value,
                    backend,
                ));
                // The lookup runs under the read's timeout and the index
                // shard's breaker. When it fails, the read asks every other
                // shard (the statement filters on the value) and reports the
                // failed one: strict reads fail with it, `.partial()` returns
                // the healthy shards' rows.
                let shards = self.shards.topology().shards_of(Self::group())?;
                let lookup_shard = match crate::key::value_text(&value) {
                    Some(text) => lookup.index_shard(&self.shards, &query, &text)?,
                    None => shards[0],
                };
                let found = lookup.lookup(&self.shards, &query, &value);
                let looked = self
                    .shards
                    .bounded(lookup_shard, Self::group(), self.timeout, found)
                    .await
                    .map(|keys| {
                        keys.map(|texts| {
                            let mut keys: Vec<KeyOf<E>> = Vec::with_capacity(texts.len());
                            for key in texts
                                .iter()
                                .filter_map(|t| KeyOf::<E>::from_directory_text(t))
                            {
                                if !keys.contains(&key) {
                                    keys.push(key);
                                }
                            }
                            keys
                        })
                    });
                let mut lookup_failed = None;
                let (spec, found) = match looked {
                    Ok(Some(mut keys)) if keys.len() == 1 => {
                        (RouteSpec::One(keys.remove(0)), Some(1))
                    }
                    Ok(Some(keys)) => {
                        let n = keys.len();
                        (RouteSpec::Many(keys), Some(n))
                    }
                    Ok(None) => (RouteSpec::All, None),
                    Err(error) => {
                        let shard = error
                            .shard()
                            .unwrap_or_else(|| self.shards.shard_name(lookup_shard))
                            .to_owned();
                        lookup_failed = Some(ShardFailure {
                            shard,
                            error: Box::new(error),
                        });
                        (RouteSpec::All, None)
                    }
                };
                (select, spec, Some((index_table, found)), lookup_failed)
            }
            other => (select, other, None, None),
        })
    }

    /// Refuses, before any I/O, an ordering a multi-shard merge cannot apply.
    fn check_mergeable(&self) -> Result<()> {
        match self
            .order
            .iter()
            .find(|(_, o)| !matches!(o, Order::Asc | Order::Desc))
        {
            Some((column, _)) => Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!(
                    "`{}` is ordered by a custom field list; a multi-shard read merges only Asc and Desc",
                    column.as_str()
                ),
            }),
            None => Ok(()),
        }
    }

    /// The per-shard statements of a multi-shard read, before ordering.
    async fn fan_out(
        &self,
        base: Select<E>,
        spec: RouteSpec<KeyOf<E>>,
    ) -> Result<Vec<(ShardId, Select<E>)>> {
        match spec {
            RouteSpec::One(key) => {
                let shard = self.shards.route::<E::Group>(&key).await?.shard;
                let backend = self.shards.shard_conn(shard).get_database_backend();
                Ok(vec![(shard, keyed_select::<E>(base, &key, backend))])
            }
            RouteSpec::All => Ok(self
                .shards
                .topology()
                .shards_of(Self::group())?
                .iter()
                .map(|id| (*id, base.clone()))
                .collect()),
            RouteSpec::Index(..) => Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: "an index read cannot nest another".to_owned(),
            }),
            RouteSpec::Many(keys) => {
                let mut seen = HashSet::with_capacity(keys.len());
                let mut by_shard: BTreeMap<ShardId, Vec<KeyOf<E>>> = BTreeMap::new();
                for key in keys {
                    if seen.contains(&key) {
                        continue;
                    }
                    let target = self.shards.route::<E::Group>(&key).await?;
                    seen.insert(key.clone());
                    by_shard.entry(target.shard).or_default().push(key);
                }
                let mut parts = Vec::new();
                for (id, keys) in by_shard {
                    let backend = self.shards.shard_conn(id).get_database_backend();
                    let mut chunk = self.key_chunk(&base, backend)?;
                    if binary_text_keys::<E>(&keys, backend) {
                        // Each key is bound twice (see `key_condition`).
                        chunk = (chunk / 2).max(1);
                    }
                    for chunk in keys.chunks(chunk) {
                        let select = base.clone().filter(key_condition::<E>(chunk, backend));
                        parts.push((id, select));
                    }
                }
                Ok(parts)
            }
        }
    }

    /// How many keys fit in one `IN` list on `backend`, leaving room for the
    /// read's own parameters and its `LIMIT`.
    fn key_chunk(&self, select: &Select<E>, backend: DbBackend) -> Result<usize> {
        let limit: usize = match backend {
            DbBackend::Sqlite => 32_766,
            _ => 65_535,
        };
        let used = backend
            .build(QueryTrait::as_query(select))
            .values
            .map_or(0, |v| v.0.len());
        let room = limit.saturating_sub(used + 2);
        if room == 0 {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: format!("the read already binds {used} parameters, the backend's limit"),
            });
        }
        Ok(room)
    }

    /// Runs every part, at most `concurrency` at once, each under the timeout.
    /// Returns the results of the shards whose every part succeeded, and one
    /// failure per shard that had any part fail.
    async fn gather<'a, T, F, Fut>(
        &'a self,
        parts: Vec<(ShardId, Select<E>)>,
        asked: usize,
        op: &'static str,
        run: F,
    ) -> (Vec<(ShardId, T)>, Vec<ShardFailure>, tracing::Span)
    where
        F: Fn(Select<E>, &'a DatabaseConnection) -> Fut,
        Fut: Future<Output = std::result::Result<T, DbErr>> + 'a,
    {
        let span = tracing::info_span!(
            "shardkit.scatter",
            group = Self::group(),
            table = table_name::<E>(),
            op = op,
            shards_asked = asked,
            shards_failed = tracing::field::Empty,
            statements = parts.len(),
            rows = tracing::field::Empty,
            peak_in_flight = tracing::field::Empty,
        );
        let cluster = &self.shards;
        let timeout = self.timeout;
        // Statements in flight, counted where they start and end, so the
        // bound is observable (`peak_in_flight` on the span).
        let in_flight = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let (in_flight, peak) = (&in_flight, &peak);
        let results: Vec<(ShardId, Result<T>)> = futures::stream::iter(parts)
            .map(|(id, select)| {
                let shard = cluster.shard_name(id);
                let now = in_flight.fetch_add(1, AtomicOrdering::Relaxed) + 1;
                peak.fetch_max(now, AtomicOrdering::Relaxed);
                let fut =
                    run(select, cluster.shard_conn(id)).instrument(read_span::<E>(shard, None, op));
                async move {
                    let fut = async { fut.await.map_err(|e| read_err::<E>(shard, e)) };
                    let result = cluster.bounded(id, Self::group(), timeout, fut).await;
                    in_flight.fetch_sub(1, AtomicOrdering::Relaxed);
                    (id, result)
                }
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .instrument(span.clone())
            .await;
        let mut ok: BTreeMap<ShardId, Vec<T>> = BTreeMap::new();
        let mut failed: BTreeMap<ShardId, ShardError> = BTreeMap::new();
        for (id, result) in results {
            match result {
                Ok(value) => ok.entry(id).or_default().push(value),
                Err(error) => {
                    failed.entry(id).or_insert(error);
                }
            }
        }
        span.record("shards_failed", failed.len());
        span.record("peak_in_flight", peak.load(AtomicOrdering::Relaxed));
        if !failed.is_empty() {
            tracing::warn!(parent: &span, failed = failed.len(), "shards failed in a multi-shard read");
        }
        let ok = ok
            .into_iter()
            .filter(|(id, _)| !failed.contains_key(id))
            .flat_map(|(id, values)| values.into_iter().map(move |v| (id, v)))
            .collect();
        let failed = failed
            .into_iter()
            .map(|(id, error)| ShardFailure {
                shard: cluster.shard_name(id).to_owned(),
                error: Box::new(error),
            })
            .collect();
        (ok, failed, span)
    }

    /// Merges per-shard rows into one ordered, paged result.
    fn merge(
        &self,
        parts: Vec<(ShardId, Vec<E::Model>)>,
        limit: Option<u64>,
        offset: u64,
    ) -> Result<Vec<E::Model>> {
        let first_shard = parts.first().map(|(id, _)| *id);
        let rows = parts.into_iter().flat_map(|(_, rows)| rows);
        let offset = offset as usize;
        let limit = limit.map_or(usize::MAX, |l| l as usize);
        if self.order.is_empty() {
            return Ok(rows.skip(offset).take(limit).collect());
        }
        // PostgreSQL sorts NULL above every value; MySQL and SQLite below.
        let nulls_high = first_shard.is_some_and(|id| {
            self.shards.shard_conn(id).get_database_backend() == DbBackend::Postgres
        });
        let mut keyed: Vec<(Vec<Value>, E::Model)> = rows
            .map(|row| (self.order.iter().map(|(c, _)| row.get(*c)).collect(), row))
            .collect();
        for (i, (column, _)) in self.order.iter().enumerate() {
            if let Some((values, _)) = keyed
                .iter()
                .find(|(v, _)| compare_values(&v[i], &v[i], nulls_high).is_none())
            {
                return Err(ShardError::Unmergeable {
                    table: table_name::<E>(),
                    reason: format!(
                        "cannot order rows from several shards by `{}`: values like {:?} have no merge order",
                        column.as_str(),
                        values[i]
                    ),
                });
            }
        }
        keyed.sort_by(|(a, _), (b, _)| {
            for (i, (_, order)) in self.order.iter().enumerate() {
                let ord = compare_values(&a[i], &b[i], nulls_high).unwrap_or(Ordering::Equal);
                let ord = if matches!(order, Order::Desc) {
                    ord.reverse()
                } else {
                    ord
                };
                if ord != Ordering::Equal {
                    return ord;
                }
            }
            Ordering::Equal
        });
        Ok(keyed
            .into_iter()
            .map(|(_, row)| row)
            .skip(offset)
            .take(limit)
            .collect())
    }
}

fn count_shards<T>(parts: &[(ShardId, T)]) -> usize {
    let mut ids: Vec<ShardId> = parts.iter().map(|(id, _)| *id).collect();
    ids.dedup();
    ids.len()
}

fn compare_values(a: &Value, b: &Value, nulls_high: bool) -> Option<Ordering> {
    fn int(v: &Value) -> Option<Option<i128>> {
        Some(match v {
            Value::TinyInt(x) => x.map(i128::from),
            Value::SmallInt(x) => x.map(i128::from),
            Value::Int(x) => x.map(i128::from),
            Value::BigInt(x) => x.map(i128::from),
            Value::TinyUnsigned(x) => x.map(i128::from),
            Value::SmallUnsigned(x) => x.map(i128::from),
            Value::Unsigned(x) => x.map(i128::from),
            Value::BigUnsigned(x) => x.map(i128::from),
            Value::Bool(x) => x.map(i128::from),
            _ => return None,
        })
    }
    fn float(v: &Value) -> Option<Option<f64>> {
        Some(match v {
            Value::Float(x) => x.map(f64::from),
            Value::Double(x) => *x,
            _ => return None,
        })
    }
    fn nulls<T>(
        a: Option<T>,
        b: Option<T>,
        nulls_high: bool,
        cmp: impl FnOnce(T, T) -> Option<Ordering>,
    ) -> Option<Ordering> {
        match (a, b) {
            (Some(a), Some(b)) => cmp(a, b),
            (None, None) => Some(Ordering::Equal),
            (None, Some(_)) => Some(if nulls_high {
                Ordering::Greater
            } else {
                Ordering::Less
            }),
            (Some(_), None) => Some(if nulls_high {
                Ordering::Less
            } else {
                Ordering::Greater
            }),
        }
    }
    if let (Some(x), Some(y)) = (int(a), int(b)) {
        return nulls(x, y, nulls_high, |x, y| Some(x.cmp(&y)));
    }
    if let (Some(x), Some(y)) = (float(a), float(b)) {
        return nulls(x, y, nulls_high, |x, y| x.partial_cmp(&y));
    }
    match (a, b) {
        (Value::String(x), Value::String(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::Char(x), Value::Char(y)) => nulls(*x, *y, nulls_high, |x, y| Some(x.cmp(&y))),
        (Value::Bytes(x), Value::Bytes(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::Uuid(x), Value::Uuid(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDate(x), Value::ChronoDate(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoTime(x), Value::ChronoTime(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTime(x), Value::ChronoDateTime(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTimeUtc(x), Value::ChronoDateTimeUtc(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        (Value::ChronoDateTimeWithTimeZone(x), Value::ChronoDateTimeWithTimeZone(y)) => {
            nulls(x.as_ref(), y.as_ref(), nulls_high, |x, y| Some(x.cmp(y)))
        }
        _ => None,
    }
}

impl<E: ShardedEntity> Find<E, Keyed<KeyOf<E>>> {
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

/// A keyed read decoded into another shape ([`Find::into_model`],
/// [`Find::into_tuple`], [`Find::into_json`]). Runs like the keyed read it
/// came from: the key's shard, the key's predicate, the read's timeout.
#[must_use = "a read does nothing until `.all()` or `.one()` runs it"]
pub struct KeyedSelect<E: ShardedEntity, S: SelectorTrait> {
    find: Find<E, Keyed<KeyOf<E>>>,
    into: fn(Select<E>) -> Selector<S>,
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

    /// The first matching row of the key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let into = self.into;
        let (read, select, spec) = self.find.split();
        let plan = read.plan(select, spec, ReadOp::One).await?;
        read.single::<Keyed<KeyOf<E>>, _, _, _>(plan, "one", |s, conn| into(s).one(conn))
            .await
    }
}

/// A read inside a [`ShardTx`](crate::ShardTx): already pinned to the
/// transaction's key and run on its connection.
#[must_use = "a read does nothing until `.all()`, `.one()` or `.count()` runs it"]
pub struct TxFind<'t, E: ShardedEntity, C> {
    conn: &'t C,
    shard: &'t str,
    select: Select<E>,
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    pub(crate) fn new(conn: &'t C, shard: &'t str, key: &KeyOf<E>) -> Self {
        TxFind {
            conn,
            shard,
            select: keyed_select::<E>(E::find(), key, conn.get_database_backend()),
        }
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<E::Model>> {
        self.select
            .all(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<E::Model>> {
        self.select
            .one(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }

    /// The number of matching rows of the transaction's key.
    pub async fn count(self) -> Result<u64>
    where
        E::Model: Sync,
    {
        self.select
            .count(self.conn)
            .await
            .map_err(|e| read_err::<E>(self.shard, e))
    }
}

impl<'t, E: ShardedEntity, C: ConnectionTrait> TxFind<'t, E, C> {
    /// Decodes each row into `M` (SeaORM's [`Select::into_model`]), inside
    /// the transaction and scoped to its key.
    pub fn into_model<M: FromQueryResult>(self) -> TxSelect<'t, C, SelectModel<M>> {
        let TxFind {
            conn,
            shard,
            select,
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_model::<M>())
    }

    /// Decodes each row into a tuple of its selected columns (SeaORM's
    /// [`Select::into_tuple`]).
    pub fn into_tuple<T: TryGetableMany>(self) -> TxSelect<'t, C, SelectGetableTuple<T>> {
        let TxFind {
            conn,
            shard,
            select,
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_tuple::<T>())
    }

    /// Decodes each row into a JSON object (SeaORM's [`Select::into_json`]).
    pub fn into_json(self) -> TxSelect<'t, C, SelectModel<sea_orm::JsonValue>> {
        let TxFind {
            conn,
            shard,
            select,
        } = self;
        TxSelect::new::<E>(conn, shard, select.into_json())
    }
}

/// A read inside a transaction decoded into another shape
/// ([`TxFind::into_model`], [`TxFind::into_tuple`], [`TxFind::into_json`]).
#[must_use = "a read does nothing until `.all()` or `.one()` runs it"]
pub struct TxSelect<'t, C, S: SelectorTrait> {
    conn: &'t C,
    shard: &'t str,
    table: &'static str,
    group: &'static str,
    selector: Selector<S>,
}

impl<'t, C: ConnectionTrait, S: SelectorTrait> TxSelect<'t, C, S> {
    fn new<E: ShardedEntity>(conn: &'t C, shard: &'t str, selector: Selector<S>) -> Self {
        TxSelect {
            conn,
            shard,
            table: table_name::<E>(),
            group: <E::Group as EntityGroup>::NAME,
            selector,
        }
    }

    /// All matching rows of the transaction's key.
    pub async fn all(self) -> Result<Vec<S::Item>> {
        let TxSelect {
            conn,
            shard,
            table,
            group,
            selector,
        } = self;
        selector
            .all(conn)
            .await
            .map_err(|source| select_err(group, table, shard, source))
    }

    /// The first matching row of the transaction's key.
    pub async fn one(self) -> Result<Option<S::Item>> {
        let TxSelect {
            conn,
            shard,
            table,
            group,
            selector,
        } = self;
        selector
            .one(conn)
            .await
            .map_err(|source| select_err(group, table, shard, source))
    }
}

/// The shard-key predicate of a read or write: `key = ?` or `key IN (...)`.
///
/// MySQL/MariaDB's default collations compare text case- and
/// trailing-space-insensitively (`'acme' = 'Acme '`), which would let one key
/// reach another key's rows on a shared shard; for text keys there the
/// predicate adds the same comparison on `CAST(key AS BINARY)`. The plain
/// comparison stays first so the key's index is still used.
pub(crate) fn key_condition<E: ShardedEntity>(keys: &[KeyOf<E>], backend: DbBackend) -> Condition {
    let column = E::shard_key_column();
    let compare = |cond: Condition, expr: Expr| match keys {
        [key] => cond.add(expr.eq(key.clone())),
        _ => cond.add(expr.is_in(keys.iter().cloned())),
    };
    let cond = compare(Condition::all(), Expr::col((E::default(), column)));
    if binary_text_keys::<E>(keys, backend) {
        compare(cond, Expr::col((E::default(), column)).cast_as("BINARY"))
    } else {
        cond
    }
}

fn binary_text_keys<E: ShardedEntity>(keys: &[KeyOf<E>], backend: DbBackend) -> bool {
    backend == DbBackend::MySql
        && keys
            .first()
            .is_some_and(|k| matches!(k.key_ref(), KeyRef::Text(_)))
}

fn keyed_select<E: ShardedEntity>(
    mut select: Select<E>,
    key: &KeyOf<E>,
    backend: DbBackend,
) -> Select<E> {
    add_key::<E>(&mut select, key, backend);
    select
}

/// Adds the one-key predicate to a statement in place.
fn add_key<E: ShardedEntity>(select: &mut Select<E>, key: &KeyOf<E>, backend: DbBackend) {
    let keys = std::slice::from_ref(key);
    let query = QueryTrait::query(select);
    if binary_text_keys::<E>(keys, backend) {
        query.cond_where(key_condition::<E>(keys, backend));
    } else {
        query.and_where(Expr::col((E::default(), E::shard_key_column())).eq(key.clone()));
    }
}

fn read_span<E: ShardedEntity>(
    shard: &str,
    bucket: Option<u32>,
    op: &'static str,
) -> tracing::Span {
    let span = tracing::info_span!(
        "shardkit.read",
        group = <E::Group as EntityGroup>::NAME,
        table = table_name::<E>(),
        shard = shard,
        bucket = tracing::field::Empty,
        op = op,
    );
    if let Some(bucket) = bucket.filter(|_| !span.is_disabled()) {
        span.record("bucket", bucket);
    }
    span
}

fn read_err<E: ShardedEntity>(shard: &str, source: DbErr) -> ShardError {
    select_err(
        <E::Group as EntityGroup>::NAME,
        table_name::<E>(),
        shard,
        source,
    )
}

fn select_err(group: &'static str, table: &str, shard: &str, source: DbErr) -> ShardError {
    ShardError::Db {
        group,
        shard: shard.to_owned(),
        operation: format!("select {table}"),
        source,
    }
}

macro_rules! select_traits {
    ($ty:ty, [$($generics:tt)*]) => {
        impl<$($generics)*> QueryOrder for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(&mut self.select)
            }
        }
        impl<$($generics)*> QuerySelect for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(&mut self.select)
            }
        }
    };
}

impl<E: ShardedEntity, R> QueryFilter for Find<E, R> {
    type QueryStatement = SelectStatement;
    fn query(&mut self) -> &mut SelectStatement {
        QueryTrait::query(&mut self.select)
    }
}

// A single-key read runs as written, so every SeaORM ordering and selection
// method is safe on it; multi-shard reads take only what they can merge.
select_traits!(Find<E, Keyed<K>>, [E: ShardedEntity, K]);
select_traits!(TxFind<'t, E, C>, ['t, E: ShardedEntity, C]);

impl<E: ShardedEntity, C> QueryFilter for TxFind<'_, E, C> {
    type QueryStatement = SelectStatement;
    fn query(&mut self) -> &mut SelectStatement {
        QueryTrait::query(&mut self.select)
    }
}
