//! Running a planned read: one shard or a fan-out under each shard's
//! breaker and the read's timeout, gathering the rows to merge.

use crate::entity::{ShardedEntity, table_name};
use crate::error::{Result, ShardError, ShardFailure};
use crate::exec::{Consistency, ReadOn, ReadTime};
use crate::read::KeyOf;
use crate::read::keys::{binary_text_keys, key_condition, keyed_select, read_err, read_span};
use crate::read::moves::owned_only;
use crate::read::plan::Plan;
use crate::read::request::Read;
use crate::read::route::{Gathered, RouteSpec, Routed};
use crate::read::select::RowStream;
use crate::topology::ShardId;
use futures::StreamExt;
use sea_orm::{DatabaseConnection, DbErr, QueryFilter, Select, Selector, SelectorTrait};
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering as AtomicOrdering;
use tracing::Instrument;

impl<E: ShardedEntity> Read<E> {
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
        F: Fn(Select<E>, &'a DatabaseConnection) -> Fut,
        Fut: Future<Output = std::result::Result<T, DbErr>>,
    {
        let Some((target, select)) = plan.single.take() else {
            return Err(ShardError::internal(format!(
                "a multi-shard plan run as a single-shard one (`{}`)",
                table_name::<E>()
            )));
        };
        // One bound for the replica's part and the shard's: the read's
        // timeout.
        let time = ReadTime::start(self.timeout, &self.consistency);
        // Reads of the primary (the default) make no replica future at all.
        // (Boxed where taken: the replica's wait would make every read's
        // future larger.)
        if !matches!(self.consistency, Consistency::Primary)
            && let Some(value) =
                Box::pin(self.on_replica(target.shard, op, &run, &select, &time)).await
        {
            return R::finish(value, self.gathered(1, Vec::new()));
        }
        let shard = self.shards.shard_name(target.shard);
        let span = read_span::<E>(shard, target.bucket, op);
        let conn = self.shards.shard_conn(target.shard);
        // Boxed once where it is made: SeaORM's future is large, and every
        // layer around it (span, breaker, timeout) would otherwise copy it.
        let fut = crate::trace::in_span(span, Box::pin(run(*select, conn)));
        let fut = async { fut.await.map_err(|e| read_err::<E>(shard, e)) };
        match time
            .on_shard(&self.shards, target.shard, Self::group(), fut)
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

    /// Runs `run` on a replica of shard `id` when the read's consistency
    /// lets one answer. `None` when the shard itself must answer: no
    /// replica may, or the one that tried failed or did not answer within
    /// the replica timeout or its part of the read's (it leaves the
    /// rotation until a good probe).
    async fn on_replica<'a, T, F, Fut>(
        &'a self,
        id: ShardId,
        op: &'static str,
        run: &F,
        select: &Select<E>,
        time: &ReadTime,
    ) -> Option<T>
    where
        F: Fn(Select<E>, &'a DatabaseConnection) -> Fut,
        Fut: Future<Output = std::result::Result<T, DbErr>>,
    {
        let ReadOn::Replica(replica) = self
            .shards
            .read_on(id, Self::group(), &self.consistency, time.replica_until())
            .await
        else {
            return None;
        };
        let shard = self.shards.shard_name(id);
        let (_slot, within) = time.replica_turn(&self.shards, replica, shard).await?;
        let fut = Box::pin(run(select.clone(), &replica.conn)).instrument(read_span::<E>(
            &replica.name,
            None,
            op,
        ));
        self.shards.on_replica(replica, within, shard, fut).await
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
            return Err(ShardError::internal(format!(
                "a multi-shard plan run as a stream (`{}`)",
                table_name::<E>()
            )));
        };
        let Read {
            shards,
            timeout,
            consistency,
            ..
        } = self;
        let group = Self::group();
        let rows = async_stream::stream! {
            let time = ReadTime::start_stream(timeout);
            let shard = shards.shard_name(target.shard);
            let primary = shards.shard_conn(target.shard).clone();
            // A replica, when the consistency lets one answer: opened and
            // its first row read under the replica timeout (the statement
            // runs when first polled), else the shard opens the stream.
            // Once rows flow, a replica that fails ends the stream with
            // its error (rows already read cannot be read again).
            let mut replica = None;
            if !matches!(consistency, Consistency::Primary)
                && let ReadOn::Replica(r) =
                    shards.read_on(target.shard, group, &consistency, time.replica_until()).await
            {
                replica = Some((r, r.conn.clone()));
            }
            let mut rows = None;
            let mut first = None;
            let mut on_replica = false;
            // A connection's turn on the replica, held while rows flow
            // from it.
            let mut turn = None;
            if let Some((r, _)) = &replica {
                turn = time.replica_turn(&shards, r, shard).await;
            }
            if let (Some((r, conn)), Some((_, within))) = (&replica, &turn) {
                let span = read_span::<E>(&r.name, target.bucket, "stream");
                let open = async {
                    let mut opened = into((*select).clone()).stream(conn).await?;
                    let head = opened.next().await.transpose()?;
                    Ok::<_, DbErr>((opened, head))
                };
                if let Some((opened, head)) =
                    shards.on_replica(r, *within, shard, crate::trace::in_span(span, open)).await
                {
                    rows = Some(opened);
                    first = Some(head);
                    on_replica = true;
                }
            }
            if !on_replica {
                // The shard answers: the replica's connection is free.
                turn = None;
            }
            let _turn = turn;
            let mut rows = match rows {
                Some(rows) => rows,
                None => {
                    let span = read_span::<E>(shard, target.bucket, "stream");
                    let open = async {
                        into(*select)
                            .stream(&primary)
                            .await
                            .map_err(|e| read_err::<E>(shard, e))
                    };
                    let opened = time
                        .on_shard(&shards, target.shard, group, crate::trace::in_span(span, open))
                        .await;
                    match opened {
                        Ok(rows) => rows,
                        Err(err) => {
                            yield Err(err);
                            return;
                        }
                    }
                }
            };
            match first {
                Some(Some(row)) => yield Ok(row),
                Some(None) => return,
                None => {}
            }
            // The shard's first row is still within the read's timeout
            // (what the replica's part left); later rows each get all of it.
            let mut first_of_shard = !on_replica;
            loop {
                let next = if on_replica {
                    let within = timeout.unwrap_or(shards.replica_timeout());
                    match tokio::time::timeout(within, rows.next()).await {
                        Ok(next) => Ok(next),
                        Err(_) => Err(ShardError::Timeout {
                            group,
                            shard: replica.as_ref().map_or(shard, |(r, _)| r.name.as_str()).to_owned(),
                            after: within,
                        }),
                    }
                } else if std::mem::take(&mut first_of_shard) {
                    let next = async { Ok(rows.next().await) };
                    time.on_shard(&shards, target.shard, group, next).await
                } else {
                    let next = async { Ok(rows.next().await) };
                    shards.bounded(target.shard, group, timeout, next).await
                };
                match next {
                    Ok(Some(Ok(row))) => yield Ok(row),
                    Ok(Some(Err(err))) => {
                        // Named by the database that failed: a replica's
                        // failure is not the shard's.
                        let from = match &replica {
                            Some((r, _)) if on_replica => r.name.as_str(),
                            _ => shard,
                        };
                        yield Err(read_err::<E>(from, err));
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
                    if binary_text_keys(&keys, backend) {
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
                let run = &run;
                async move {
                    // Each part's replica and shard share its timeout.
                    let time = ReadTime::start(timeout, &self.consistency);
                    if !matches!(self.consistency, Consistency::Primary)
                        && let Some(value) = self.on_replica(id, op, run, &select, &time).await
                    {
                        in_flight.fetch_sub(1, AtomicOrdering::Relaxed);
                        return (id, Ok(value));
                    }
                    let fut = Box::pin(run(select, cluster.shard_conn(id)))
                        .instrument(read_span::<E>(shard, None, op));
                    let fut = async { fut.await.map_err(|e| read_err::<E>(shard, e)) };
                    let result = time.on_shard(cluster, id, Self::group(), fut).await;
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
}
