//! The one executor of read plans: routing, fan-out under each shard's
//! breaker and the read's timeout, and the merge.

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError, ShardFailure};
use crate::exec::Shards;
use crate::read::find::RowStream;
use crate::read::index::{IndexLookup, IndexQuery, exact_eq};
use crate::read::keys::{
    add_key, binary_text_keys, key_condition, keyed_select, read_err, read_span,
};
use crate::read::plan::{MergePlan, Plan, PlannedRoute, PlannedStatement, ReadOp, ReadPlan};
use crate::read::route::{Gathered, RouteSpec, Routed};
use crate::read::{KeyOf, MoveMark, ReadFrom, ReadGuard, read_from};
use crate::topology::ShardId;
use futures::StreamExt;
use sea_orm::sea_query::Expr;
use sea_orm::{
    DatabaseConnection, DbBackend, DbErr, IdenStatic, IntoSimpleExpr, ModelTrait, Order,
    QueryFilter, QuerySelect, QueryTrait, Select, Selector, SelectorTrait, Value,
};
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Duration;
use tracing::Instrument;

/// A read with its routing taken out: what every execution path shares.
pub(super) struct Read<E: ShardedEntity> {
    pub(super) shards: Shards,
    pub(super) index: Option<Arc<dyn IndexLookup>>,
    pub(super) guard: Option<Arc<dyn ReadGuard>>,
    pub(super) joined: Option<(std::any::TypeId, &'static str)>,
    pub(super) order: Vec<(E::Column, Order)>,
    pub(super) limit: Option<u64>,
    pub(super) offset: Option<u64>,
    pub(super) timeout: Option<Duration>,
    pub(super) concurrency: usize,
}

impl<E: ShardedEntity> Read<E> {
    pub(super) fn group() -> &'static str {
        <E::Group as EntityGroup>::NAME
    }

    pub(super) fn gathered(&self, asked: usize, failed: Vec<ShardFailure>) -> Gathered {
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
    pub(super) async fn plan(
        &self,
        select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
        op: ReadOp,
    ) -> Result<Plan<E>> {
        let mut select = select;
        if let Some(refresh) = self
            .guard
            .as_ref()
            .and_then(|g| g.before_routing(Self::group()))
        {
            refresh.await;
        }
        let from = match &self.guard {
            Some(guard) => {
                if let Some((joined, table)) = self.joined {
                    // Its side was joined from the right table when the read
                    // was made; a refusal still stands.
                    guard.check(joined, table)?;
                }
                guard.check(std::any::TypeId::of::<E>(), table_name::<E>())?
            }
            None => None,
        };
        if let Some(from) = &from {
            read_from::<E>(&mut select, from.table);
        }
        let (mut select, spec, index, lookup_failed) = match spec {
            RouteSpec::Index(..) => self.resolve_index(select, spec, from.as_ref()).await?,
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
                owners: None,
            });
        }
        self.check_mergeable()?;
        let route = described(match &spec {
            RouteSpec::Many(keys) => PlannedRoute::Keys { keys: keys.len() },
            _ => PlannedRoute::Scatter,
        });
        // Taken before the shards are chosen: a shard the map gives a
        // bucket later is asked too, and the rows kept are those of the
        // owners this map names (which keep them until cleaning).
        let owners = match &spec {
            RouteSpec::All => self.map_snapshot(),
            _ => None,
        };
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
            owners,
        })
    }

    /// The printable form of a plan.
    pub(super) fn describe(&self, plan: Plan<E>, partial: bool) -> ReadPlan {
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
    pub(super) async fn single<'a, R, T, F, Fut>(
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
        // Boxed once where it is made: SeaORM's future is large, and every
        // layer around it (span, breaker, timeout) would otherwise copy it.
        let fut = crate::trace::in_span(span, Box::pin(run(*select, conn)));
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

    /// Runs a plan whose one key's shard answers as a stream of rows
    /// ([`Find::stream`]). The stream owns what it needs (a handle on the
    /// shards and the shard's pool), so it outlives the read that made it;
    /// opening it and every later row run under the shard's breaker and the
    /// read's timeout, and the first row (or the error) has arrived when this
    /// returns.
    pub(super) async fn stream<S>(
        self,
        mut plan: Plan<E>,
        into: fn(Select<E>) -> Selector<S>,
    ) -> Result<RowStream<'static, S::Item>>
    where
        S: SelectorTrait + Send + 'static,
        S::Item: Send + 'static,
    {
        let Some((target, select)) = plan.single.take() else {
            return Err(ShardError::Unmergeable {
                table: table_name::<E>(),
                reason: "internal: a multi-shard plan run as a stream".to_owned(),
            });
        };
        let Read {
            shards, timeout, ..
        } = self;
        let group = Self::group();
        let rows = async_stream::stream! {
            let shard = shards.shard_name(target.shard);
            let conn = shards.shard_conn(target.shard).clone();
            let span = read_span::<E>(shard, target.bucket, "stream");
            let open = async {
                into(*select)
                    .stream(&conn)
                    .await
                    .map_err(|e| read_err::<E>(shard, e))
            };
            let opened = shards
                .bounded(target.shard, group, timeout, crate::trace::in_span(span, open))
                .await;
            let mut rows = match opened {
                Ok(rows) => rows,
                Err(err) => {
                    yield Err(err);
                    return;
                }
            };
            loop {
                let next = async { Ok(rows.next().await) };
                match shards.bounded(target.shard, group, timeout, next).await {
                    Ok(Some(Ok(row))) => yield Ok(row),
                    Ok(Some(Err(err))) => {
                        yield Err(read_err::<E>(shard, err));
                        return;
                    }
                    Ok(None) => return,
                    Err(err) => {
                        yield Err(err);
                        return;
                    }
                }
            }
        };
        let mut rows = Box::pin(rows.peekable());
        if let Some(Err(err)) = rows.as_mut().next_if(|row| row.is_err()).await {
            return Err(err);
        }
        Ok(rows)
    }

    /// A `movable` group's map now (`None` for other groups).
    fn map_snapshot(&self) -> Option<crate::topology::MapSnapshot> {
        let topology = self.shards.topology();
        if !topology.is_movable(Self::group()) {
            return None;
        }
        topology
            .live_owners(Self::group())
            .ok()
            .flatten()
            .map(|map| map.snapshot())
    }

    /// The group's moves as a count or projection of a plan needs them:
    /// `None` when the plan cannot see a row twice (not a scatter of a
    /// `movable` group).
    pub(super) async fn move_mark(&self, scatters_movable: bool) -> Option<MoveMark> {
        if !scatters_movable {
            return None;
        }
        match self.guard.as_ref().and_then(|g| g.move_mark(Self::group())) {
            Some(asked) => Some(asked.await),
            // No guard (not a cluster's read): nothing says there is no move.
            None => Some(None),
        }
    }

    /// Counts the plan's rows, each once: whole rows of every shard, kept
    /// where the plan's map says they live, counted (no limit, offset or
    /// order applies to a count).
    pub(super) async fn count_owned(
        &self,
        parts: Vec<(ShardId, Select<E>)>,
        asked: usize,
        lookup_failed: Option<ShardFailure>,
        owners: Option<&crate::topology::MapSnapshot>,
    ) -> (Result<u64>, Gathered) {
        let parts: Vec<(ShardId, Select<E>)> = parts
            .into_iter()
            .map(|(id, select)| {
                (
                    id,
                    select
                        .select_only()
                        .columns(<E::Column as sea_orm::Iterable>::iter()),
                )
            })
            .collect();
        let (ok, mut failed, span) = self
            .gather(parts, asked, "count", |s, conn| s.all(conn))
            .await;
        let asked = asked + usize::from(lookup_failed.is_some());
        failed.extend(lookup_failed);
        let n: u64 = owned_only::<E>(ok, owners)
            .iter()
            .map(|(_, rows)| rows.len() as u64)
            .sum();
        span.record("rows", n);
        (Ok(n), self.gathered(asked, failed))
    }

    /// Runs a multi-shard plan of rows: gather, merge.
    pub(super) async fn rows(
        &self,
        plan: Plan<E>,
        op: &'static str,
    ) -> (Result<Vec<E::Model>>, Gathered) {
        let asked = plan.asked;
        let (ok, mut failed, span) = self
            .gather(plan.parts, asked, op, |s, conn| s.all(conn))
            .await;
        let asked = asked + usize::from(plan.lookup_failed.is_some());
        failed.extend(plan.lookup_failed);
        // A shard's limited page keeps its place when rows it does not own
        // are dropped from it: each such row is a copy of a row its owner
        // holds with the same values, which ranks the same there, so every
        // owned row the page lost ranks below the page's length of other
        // rows and is not in the merged result either.
        let ok = owned_only::<E>(ok, plan.owners.as_ref());
        let rows = self.merge(ok, plan.limit, plan.offset);
        if let Ok(rows) = &rows {
            span.record("rows", rows.len());
        }
        (rows, self.gathered(asked, failed))
    }

    /// Applies ordering and paging. A single shard gets them as written; a
    /// shard of a multi-shard read returns its first `limit + offset` rows and
    /// the merge applies the offset.
    pub(super) fn shape(&self, select: &mut Select<E>, limit: Option<u64>, single: bool) {
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
    pub(super) async fn resolve_index(
        &self,
        mut select: Box<Select<E>>,
        spec: RouteSpec<KeyOf<E>>,
        from: Option<&ReadFrom>,
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
                let mut query = IndexQuery {
                    group: Self::group(),
                    entity: table_name::<E>(),
                    column: col.as_str(),
                    unique: *unique,
                };
                // Read from another table: its index on the column is the
                // one kept; without one, every shard is asked (the
                // statement filters on the value).
                let other_index = from.map(|f| {
                    (
                        f.table,
                        f.indexes
                            .iter()
                            .find(|(c, _)| *c == query.column)
                            .map(|(_, u)| *u),
                    )
                });
                if let Some((table, unique)) = other_index {
                    query.entity = table;
                    query.unique = unique.unwrap_or(query.unique);
                }
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
                if let Some((_, None)) = other_index {
                    return Ok((select, RouteSpec::All, None, None));
                }
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
    pub(super) fn check_mergeable(&self) -> Result<()> {
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
    pub(super) async fn fan_out(
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
                .scatter_shards(Self::group())?
                .into_iter()
                .map(|id| (id, base.clone()))
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
    pub(super) fn key_chunk(&self, select: &Select<E>, backend: DbBackend) -> Result<usize> {
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
    pub(super) async fn gather<'a, T, F, Fut>(
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
                let fut = Box::pin(run(select, cluster.shard_conn(id)))
                    .instrument(read_span::<E>(shard, None, op));
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
        crate::metrics::scatter(Self::group(), asked, !failed.is_empty());
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
    pub(super) fn merge(
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

pub(super) fn count_shards<T>(parts: &[(ShardId, T)]) -> usize {
    let mut ids: Vec<ShardId> = parts.iter().map(|(id, _)| *id).collect();
    ids.dedup();
    ids.len()
}

pub(crate) fn compare_values(a: &Value, b: &Value, nulls_high: bool) -> Option<Ordering> {
    pub(super) fn int(v: &Value) -> Option<Option<i128>> {
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
    pub(super) fn float(v: &Value) -> Option<Option<f64>> {
        Some(match v {
            Value::Float(x) => x.map(f64::from),
            Value::Double(x) => *x,
            _ => return None,
        })
    }
    pub(super) fn nulls<T>(
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

/// For a scatter of a `movable` group, only each shard's rows of the
/// buckets `owners` (the plan's map) says it owns: while a bucket moves,
/// its rows are on the source and (copied, or not yet cleaned) on the
/// target, and a row must be read once.
fn owned_only<E: ShardedEntity>(
    parts: Vec<(ShardId, Vec<E::Model>)>,
    owners: Option<&crate::topology::MapSnapshot>,
) -> Vec<(ShardId, Vec<E::Model>)> {
    let Some(map) = owners else {
        return parts;
    };
    parts
        .into_iter()
        .map(|(id, rows)| {
            let rows = rows
                .into_iter()
                .filter(|m| map.owner_of(&E::shard_key(m)) == Some(id))
                .collect();
            (id, rows)
        })
        .collect()
}
