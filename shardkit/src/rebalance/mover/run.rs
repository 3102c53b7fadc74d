//! The mover's run loop: taking a move, copying, catching up, cutting over, cleaning, and aborting.

use crate::error::{Result, ShardError};
use crate::job::JobControl;
use crate::rebalance::entity::Buckets;
use crate::rebalance::fencing::Token;
use crate::rebalance::map::{BucketState, control, set_states};
use crate::rebalance::mover::{CATCH_UP, CLAIMS, MOVES, refused};
use crate::rebalance::{MovePhase, MovePlan, MoveProgress, MoveStatus, Rebalance, db_err};
use crate::topology::{LiveMap, RangeUnit, ShardId};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, DbErr, Statement};
use std::time::Duration;

impl<G> Rebalance<G> {
    /// The progress and cancellation of [`run`](Self::run), as every long
    /// job takes them: the callback is called at every phase change, after
    /// every run of copied chunks and after every replay round; once the
    /// token is cancelled, `run` stops at the next chunk of its copy, the
    /// next round of its replay or the next phase (a cut-over under way is
    /// finished first), lets the move go and returns its status, the move's
    /// position saved; run it again, from any process, to resume.
    pub fn control(mut self, control: JobControl<MoveProgress>) -> Self {
        self.control = control;
        self
    }

    /// Makes [`run`](Self::run) wait out the cleanup grace period (sleeping)
    /// instead of returning in `cleaning`.
    pub fn wait_for_grace(mut self, wait: bool) -> Self {
        self.wait_for_grace = wait;
        self
    }

    pub(super) fn refuse(&self, id: Option<i64>, reason: impl Into<String>) -> ShardError {
        refused(id, reason)(self.group)
    }

    pub(super) fn map(&self) -> Result<LiveMap<'_>> {
        if !self.shards.topology().is_movable(self.group) {
            return Err(self.refuse(
                None,
                format!("the group is not movable: set `movable = true` under [groups.{}] on every instance", self.group),
            ));
        }
        match self.shards.topology().live_owners(self.group)? {
            Some(map) => Ok(map),
            None => Err(self.refuse(None, "only hash and range placements move")),
        }
    }

    /// The moving units (buckets, or ranges by id) as the copy, compare and
    /// clean-up test rows against them.
    pub(super) async fn moving(&self, ids: &[u32]) -> Result<Buckets> {
        match self.map()? {
            LiveMap::Buckets(owners) => Ok(Buckets::hash(owners.len() as u32, ids.iter().copied())),
            LiveMap::Ranges(ranges) => {
                let pick = || -> Vec<RangeUnit> {
                    ranges
                        .units()
                        .iter()
                        .filter(|u| ids.contains(&u.id))
                        .cloned()
                        .collect()
                };
                let mut units = pick();
                if units.len() != ids.len() {
                    // A range made by a split after this process read the map.
                    crate::rebalance::map::refresh(&self.shards, self.group).await?;
                    units = pick();
                }
                if units.len() != ids.len() {
                    return Err(self.refuse(
                        None,
                        format!(
                            "the map has {} of the move's ranges {ids:?}: a range a move holds is never split",
                            units.len()
                        ),
                    ));
                }
                Ok(Buckets::Ranges(units))
            }
        }
    }

    pub(super) fn shard_id(&self, name: &str) -> Result<ShardId> {
        self.shards.topology().shard_id(name).ok_or_else(|| {
            self.refuse(
                None,
                format!(
                    "no shard is named `{name}`; defined shards: {}",
                    self.shards
                        .topology()
                        .shard_names()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })
    }

    pub(super) fn control_db(&self) -> Result<(&DatabaseConnection, &str)> {
        let id = control(&self.shards, self.group)?;
        Ok((self.shards.side_conn(id), self.shards.shard_name(id)))
    }

    /// Records the move and holds its buckets; refused when another move
    /// that is not finished holds one of them.
    pub async fn start(&self, plan: &MovePlan) -> Result<MoveStatus> {
        let map = self.map()?;
        if plan.group != self.group {
            return Err(self.refuse(None, format!("the plan is for group `{}`", plan.group)));
        }
        if self.entities.iter().all(|e| e.implicit()) {
            return Err(self.refuse(
                None,
                "no entity listed: add every entity of the group with `.entity::<E>()`",
            ));
        }
        self.shard_id(&plan.target)?;
        // The plan must name each bucket's owner now (another move may have
        // finished since it was made).
        crate::rebalance::map::refresh(&self.shards, self.group).await?;
        if let LiveMap::Ranges(_) = map {
            // A split's old range must be fenced on its shard before any
            // half moves (a split that stopped before fencing it is
            // finished here).
            self.retire_split_ranges().await?;
        }
        let mut sources = Vec::new();
        for (_, from) in &plan.buckets {
            let id = self.shard_id(from)?;
            if !sources.contains(&id) {
                sources.push(id);
            }
        }
        self.tables_apart(None, &sources, self.shard_id(&plan.target)?)
            .await?;
        let snapshot = map.snapshot();
        for (b, from) in &plan.buckets {
            let now_on = snapshot
                .owner(*b)
                .map_or("no shard (no such bucket or range)", |s| {
                    self.shards.shard_name(s)
                });
            if now_on != from {
                return Err(self.refuse(
                    None,
                    format!(
                        "the plan is stale: bucket {b} is on `{now_on}`, not `{from}`; plan again"
                    ),
                ));
            }
        }
        let (db, name) = self.control_db()?;
        let err = |e| db_err(name, MOVES, "register", e);
        let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
        let held = Query::select()
            .columns([Alias::new("bucket"), Alias::new("move_id")])
            .from(Alias::new(CLAIMS))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(
                Expr::col(Alias::new("bucket")).is_in(plan.buckets.iter().map(|(b, _)| *b as i32)),
            )
            .limit(1)
            .to_owned();
        if let Some(row) = txn.query_one(&held).await.map_err(err)? {
            let bucket: i32 = row.try_get("", "bucket").map_err(err)?;
            let other: i64 = row.try_get("", "move_id").map_err(err)?;
            return Err(self.refuse(
                None,
                format!("bucket {bucket} is held by move #{other}, which is not finished: run or abort it first"),
            ));
        }
        let now = self.shards.now_ms();
        let buckets = plan
            .buckets
            .iter()
            .map(|(b, s)| format!("{b}:{s}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut insert = Query::insert();
        insert
            .into_table(Alias::new(MOVES))
            .columns(
                [
                    "grp",
                    "target",
                    "buckets",
                    "phase",
                    "rows_copied",
                    "changes_applied",
                    "created_ms",
                    "updated_ms",
                    "tables",
                ]
                .map(Alias::new),
            )
            .values_panic([
                self.group.into(),
                plan.target.clone().into(),
                buckets.into(),
                MovePhase::Registered.as_str().into(),
                0i64.into(),
                0i64.into(),
                now.into(),
                now.into(),
                self.tables().into(),
            ]);
        let id: i64 = if txn.get_database_backend() == DbBackend::MySql {
            txn.execute(&insert).await.map_err(err)?.last_insert_id() as i64
        } else {
            insert.returning_col(Alias::new("id"));
            let row = txn.query_one(&insert).await.map_err(err)?;
            row.ok_or_else(|| err(DbErr::RecordNotInserted))?
                .try_get("", "id")
                .map_err(err)?
        };
        for chunk in plan.buckets.chunks(500) {
            let mut claim = Query::insert();
            claim
                .into_table(Alias::new(CLAIMS))
                .columns(["grp", "bucket", "move_id"].map(Alias::new));
            for (b, _) in chunk {
                claim.values_panic([self.group.into(), (*b as i32).into(), id.into()]);
            }
            match txn.execute(&claim).await {
                Ok(_) => {}
                Err(e) if crate::error::is_unique_violation(&e) => {
                    return Err(self.refuse(
                        None,
                        "another move took one of its buckets at the same time: run or abort it first",
                    ));
                }
                Err(e) => return Err(err(e)),
            }
        }
        txn.commit().await.map_err(err)?;
        tracing::info!(group = self.group, id, target = %plan.target, buckets = plan.buckets.len(), "move registered");
        self.status(id).await
    }

    /// Fault injection: `shardkit::rebalance::<step>` fails the mover at
    /// that step when its argument is part of the target database's URL
    /// (any move, without one).
    #[allow(unused_variables)]
    pub(super) fn failpoint(&self, step: &str, id: i64, target: ShardId) -> Result<()> {
        #[cfg(feature = "failpoints")]
        if self.fires(&format!("shardkit::rebalance::{step}"), target) {
            return Err(self.refuse(Some(id), format!("failpoint shardkit::rebalance::{step}")));
        }
        Ok(())
    }

    /// Fault injection: whether failpoint `name` fires for a move to
    /// `target`: its argument is part of the target database's URL (any
    /// move, without one).
    #[cfg(feature = "failpoints")]
    pub(super) fn fires(&self, name: &str, target: ShardId) -> bool {
        fail::eval(name, |arg| arg.unwrap_or_default()).is_some_and(|arg| {
            self.shards
                .topology()
                .shard(target)
                .url
                .expose()
                .contains(arg.as_str())
        })
    }

    /// `work` (one step against `shard`) bounded by `[rebalance]
    /// step_timeout_ms`: a shard that stops answering fails the mover
    /// instead of holding it; run the move again when the shard is back.
    pub(super) async fn timed<T>(
        &self,
        shard: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let step = self.shards.rebalance_settings().step_timeout;
        crate::rebalance::entity::bounded(self.group, step, shard, work).await
    }

    pub(super) fn conn(&self, id: ShardId) -> (&DatabaseConnection, &str) {
        (self.shards.side_conn(id), self.shards.shard_name(id))
    }

    fn report(&self, status: &MoveStatus, started: (i64, u64), estimated: u64, pending: u64) {
        let elapsed_ms = Ord::max(self.shards.now_ms() - started.0, 1) as f64;
        let rate = (status.rows_copied.saturating_sub(started.1)) as f64 * 1000.0 / elapsed_ms;
        let eta = (rate > 0.0 && estimated > status.rows_copied)
            .then(|| Duration::from_secs_f64((estimated - status.rows_copied) as f64 / rate));
        crate::metrics::move_pending(self.group, pending);
        tracing::debug!(group = self.group, id = status.id, phase = %status.phase, rows = status.rows_copied, rate, pending, "move progress");
        self.control.report(&MoveProgress {
            id: status.id,
            phase: status.phase,
            rows_copied: status.rows_copied,
            rows_per_sec: rate,
            rows_estimated: estimated,
            pending_changes: pending,
            eta,
        });
    }

    /// Runs move `id` from its stored phase as far as it can go: to `done`,
    /// or to `cleaning` when the grace period has not passed (unless
    /// [`wait_for_grace`](Self::wait_for_grace)). Run it again, from any
    /// process, to resume a move whose mover stopped or failed.
    ///
    /// One process runs a move at a time: another `run` or `abort` of it is
    /// refused while this one holds it (it lets go when it returns, and its
    /// hold lapses 10 s after its last renewal if the process dies; it renews
    /// it every 3 s while it runs). A mover that goes on after another process
    /// took the move over (it was paused past its hold) is refused by every
    /// shard it writes, nothing written: the fencing tokens of
    /// [`crate::rebalance`].
    pub async fn run(&self, id: i64) -> Result<MoveStatus> {
        if self.entities.iter().all(|e| e.implicit()) {
            return Err(self.refuse(
                Some(id),
                "no entity listed: add every entity of the group with `.entity::<E>()`",
            ));
        }
        let Some(token) = self.acquire(id).await? else {
            return self.status(id).await;
        };
        let result = self.holding(&token, self.run_inner(&token, id)).await;
        if let Err(e) = &result
            && let Ok((mut status, cursor)) = self.read(id).await
            && !status.phase.is_finished()
        {
            status.error = Some(e.report().to_string());
            let _ = self.save(&token, &status, cursor.as_deref(), |_| {}).await;
        }
        self.let_go(id, Some(token.generation())).await;
        result
    }

    async fn run_inner(&self, token: &Token, id: i64) -> Result<MoveStatus> {
        self.map()?;
        if self.entities.iter().all(|e| e.implicit()) {
            return Err(self.refuse(
                Some(id),
                "no entity listed: add every entity of the group with `.entity::<E>()`",
            ));
        }
        let (mut status, mut cursor) = self.read(id).await?;
        status.error = None;
        let settings = &self.shards.rebalance_settings();
        let target = self.shard_id(&status.target)?;
        let started = (self.shards.now_ms(), status.rows_copied);
        let mut estimated = 0u64;
        loop {
            if self.control.is_cancelled() && status.phase != MovePhase::CuttingOver {
                return self.status(id).await;
            }
            match status.phase {
                MovePhase::Registered => {
                    self.failpoint("registered", id, target)?;
                    for (src, buckets) in self.sources(&status)? {
                        let (db, name) = self.conn(src);
                        let moving = set_states(
                            Some(token),
                            (db, name),
                            self.group,
                            &buckets,
                            &[BucketState::Owned, BucketState::Moving],
                            BucketState::Moving,
                            Some(id),
                            None,
                        )
                        .await?;
                        if moving != buckets.len() as u64 {
                            return Err(self.refuse(
                                Some(id),
                                format!(
                                    "shard `{name}` owns {moving} of the {} buckets the move takes from it: the plan is stale; abort the move and plan again",
                                    buckets.len()
                                ),
                            ));
                        }
                    }
                    self.set_phase(token, &mut status, MovePhase::Copying)
                        .await?;
                }
                MovePhase::Copying => {
                    self.failpoint("copying", id, target)?;
                    self.schemas_agree(token, &mut status, target).await?;
                    // The rows copied may reference the reference tables.
                    self.references.catch_up_all(target).await?;
                    let sources = self.sources(&status)?;
                    if estimated == 0 {
                        estimated = self.estimate(&sources).await?;
                    }
                    // `<source index>/<entity index>/<primary key>`.
                    let (mut si, mut ei, mut after) = parse_copy_cursor(cursor.as_deref());
                    while si < sources.len() {
                        let (src, buckets) = &sources[si];
                        let only_here = self.moving(buckets).await?;
                        while ei < self.entities.len() {
                            let entity = &self.entities[ei];
                            loop {
                                // Chunks are read ahead of their writes in
                                // runs of this many; the position is saved
                                // after each run.
                                const RUN: usize = 4;
                                let copy = |skip_logged: bool| {
                                    self.timed(
                                        self.shards.shard_name(target),
                                        entity.copy_chunks(
                                            token,
                                            self.conn(*src),
                                            self.conn(target),
                                            after.as_deref(),
                                            settings.copy_chunk(entity.by_copy(
                                                self.conn(*src).0.get_database_backend(),
                                                self.conn(target).0.get_database_backend(),
                                            )),
                                            RUN,
                                            &only_here,
                                            skip_logged,
                                        ),
                                    )
                                };
                                let chunk = match copy(false).await {
                                    // A row whose parent was written after
                                    // the parent's table was copied: its key
                                    // is logged. Replay the log, then copy
                                    // again leaving logged keys to the
                                    // replay (writers keep adding parents
                                    // and children; a copy that waited for
                                    // a quiet moment might never finish).
                                    Err(e) if foreign_key(&e) => {
                                        tracing::debug!(
                                            group = self.group,
                                            id,
                                            table = %entity.table(),
                                            "a copied row's parent is not on the target yet; replaying, then copying without logged keys"
                                        );
                                        // Bounded: under steady writes the
                                        // log never empties.
                                        self.replay(token, &mut status, Some(CATCH_UP)).await?;
                                        copy(true).await?
                                    }
                                    other => other?,
                                };
                                status.rows_copied += chunk.rows;
                                crate::metrics::move_copied(self.group, chunk.rows);
                                after = chunk.next;
                                let c = copy_cursor(si, ei, after.as_deref());
                                self.save(token, &status, Some(&c), |_| {}).await?;
                                self.report(&status, started, estimated, 0);
                                self.failpoint("copy_chunk", id, target)?;
                                // Also past an entity's last chunk: the
                                // saved position is the next entity's start.
                                if self.control.is_cancelled() {
                                    return self.status(id).await;
                                }
                                if after.is_none() {
                                    break;
                                }
                            }
                            ei += 1;
                        }
                        si += 1;
                        ei = 0;
                    }
                    cursor = None;
                    self.set_phase(token, &mut status, MovePhase::CatchingUp)
                        .await?;
                }
                MovePhase::CatchingUp => {
                    self.failpoint("catching_up", id, target)?;
                    // Replay until a round finds little left, then compare.
                    for _ in 0..100 {
                        if self.control.is_cancelled() {
                            return self.status(id).await;
                        }
                        let n = self.replay(token, &mut status, Some(CATCH_UP)).await?;
                        let pending = self.pending(&status).await?;
                        self.save(token, &status, None, |_| {}).await?;
                        self.report(&status, started, estimated, pending);
                        if n < 10_000 && pending < 1_000 {
                            break;
                        }
                    }
                    self.compare(token, &mut status, target, settings.chunk())
                        .await?;
                    self.set_phase(token, &mut status, MovePhase::Verified)
                        .await?;
                }
                MovePhase::Verified => {
                    self.failpoint("verified", id, target)?;
                    self.set_phase(token, &mut status, MovePhase::CuttingOver)
                        .await?;
                }
                MovePhase::CuttingOver => {
                    self.cut_over(token, &mut status, target, settings).await?;
                }
                MovePhase::Cleaning => {
                    self.failpoint("cleaning", id, target)?;
                    // The longest grace of any process that read the map:
                    // an instance may route by a map that old.
                    let grace = crate::rebalance::map::recorded_grace(&self.shards, self.group)
                        .await?
                        .map_or(settings.cleanup_grace, |g| g.max(settings.cleanup_grace));
                    let due = status
                        .cutover_ms
                        .unwrap_or_default()
                        .saturating_add(i64::try_from(grace.as_millis()).unwrap_or(i64::MAX));
                    let now = self.shards.now_ms();
                    if now < due {
                        if !self.wait_for_grace {
                            return self.status(id).await;
                        }
                        tokio::time::sleep(Duration::from_millis((due - now) as u64)).await;
                        continue;
                    }
                    self.clean(token, &mut status, cursor.take()).await?;
                    self.set_phase(token, &mut status, MovePhase::Done).await?;
                }
                MovePhase::Done | MovePhase::Aborted => return self.status(id).await,
            }
        }
    }

    async fn estimate(&self, sources: &[(ShardId, Vec<u32>)]) -> Result<u64> {
        let mut total = 0u64;
        for (src, buckets) in sources {
            let (db, name) = self.conn(*src);
            let owned = self
                .shards
                .topology()
                .live_owners(self.group)?
                .map_or(1, |map| {
                    map.snapshot()
                        .units()
                        .iter()
                        .filter(|(_, s)| s == src)
                        .count()
                })
                .max(buckets.len());
            for entity in &self.entities {
                let stmt = Statement::from_string(
                    db.get_database_backend(),
                    format!(
                        "SELECT COUNT(*) AS n FROM {}",
                        entity.table().quoted(db.get_database_backend())
                    ),
                );
                let n: i64 = db
                    .query_one_raw(stmt)
                    .await
                    .map_err(|e| db_err(name, &entity.table().to_string(), "count", e))?
                    .and_then(|r| r.try_get("", "n").ok())
                    .unwrap_or(0);
                total += n as u64 * buckets.len() as u64 / owned.max(1) as u64;
            }
        }
        Ok(total)
    }
}

/// Whether a database refused a row for its foreign key.
pub(super) fn foreign_key(e: &ShardError) -> bool {
    matches!(e, ShardError::Db { source, .. }
        if matches!(source.sql_err(), Some(sea_orm::SqlErr::ForeignKeyConstraintViolation(_))))
}

/// `<source index>/<entity index>/<primary key>`; past the entity's last
/// chunk, the next entity's start.
pub(super) fn copy_cursor(si: usize, ei: usize, after: Option<&str>) -> String {
    match after {
        Some(a) => format!("{si}/{ei}/{a}"),
        None => format!("{si}/{}/", ei + 1),
    }
}

pub(super) fn parse_copy_cursor(text: Option<&str>) -> (usize, usize, Option<String>) {
    let Some(text) = text else {
        return (0, 0, None);
    };
    let mut parts = text.splitn(3, '/');
    let si = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let ei = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let after = parts.next().filter(|p| !p.is_empty()).map(str::to_owned);
    (si, ei, after)
}
