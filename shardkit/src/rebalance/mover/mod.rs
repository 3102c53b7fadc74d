//! Planning, running, resuming and aborting bucket moves.

use super::entity::{Buckets, MoveEntity, Mover};
use super::fencing::Token;
use super::map::{BucketState, CHANGES, EPOCHS, MAP, control, set_states};
use super::*;
use crate::topology::{MapSnapshot, find_bound};

const MOVES: &str = "shardkit_moves";
const CLAIMS: &str = "shardkit_move_buckets";

/// How long a mover's hold on a move lasts after it last renewed it: another
/// process may take a move over (resume or abort it) once its runner has
/// been silent this long (a mover that died or is paused). A running mover
/// renews its hold every third of this; a mover paused past it is refused
/// by the fencing tokens when it goes on.
pub(crate) const LEASE_MS: i64 = 10_000;

/// Log entries one catch-up round replays at most per source, while
/// writers go on (a replay until the log is empty would never end under a
/// steady write load on the moving buckets).
const CATCH_UP: u64 = 10_000;

/// A move's phase, as `shardkit_moves.phase` stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MovePhase {
    /// Recorded; its buckets are held.
    Registered,
    /// The sources log writes; rows are being copied.
    Copying,
    /// Logged keys are being replayed.
    CatchingUp,
    /// Source and target compared equal.
    Verified,
    /// Writes are fenced; the last keys are replayed and the map flips.
    CuttingOver,
    /// The target owns the buckets; the sources' copies wait for the grace
    /// period, then are deleted.
    Cleaning,
    /// Finished.
    Done,
    /// Aborted before the cut-over: the sources still own the buckets.
    Aborted,
}

impl MovePhase {
    const ALL: [MovePhase; 8] = [
        MovePhase::Registered,
        MovePhase::Copying,
        MovePhase::CatchingUp,
        MovePhase::Verified,
        MovePhase::CuttingOver,
        MovePhase::Cleaning,
        MovePhase::Done,
        MovePhase::Aborted,
    ];

    /// The stored name (`registered`, `copying`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            MovePhase::Registered => "registered",
            MovePhase::Copying => "copying",
            MovePhase::CatchingUp => "catching_up",
            MovePhase::Verified => "verified",
            MovePhase::CuttingOver => "cutting_over",
            MovePhase::Cleaning => "cleaning",
            MovePhase::Done => "done",
            MovePhase::Aborted => "aborted",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == text)
    }

    /// Whether the move is over (done or aborted).
    pub fn is_finished(self) -> bool {
        matches!(self, MovePhase::Done | MovePhase::Aborted)
    }
}

impl std::fmt::Display for MovePhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The buckets a move takes, where each comes from, and where they go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MovePlan {
    /// The group.
    pub group: String,
    /// The shard the buckets move to.
    pub target: String,
    /// Each moving bucket and the shard that owns it now.
    pub buckets: Vec<(u32, String)>,
}

/// A move as stored.
#[derive(Clone, Debug)]
pub struct MoveStatus {
    /// Its id.
    pub id: i64,
    /// The group.
    pub group: String,
    /// Where the buckets go.
    pub target: String,
    /// Each bucket and where it comes from.
    pub buckets: Vec<(u32, String)>,
    /// The phase.
    pub phase: MovePhase,
    /// Rows copied so far.
    pub rows_copied: u64,
    /// Logged keys replayed so far.
    pub changes_applied: u64,
    /// Logged keys not yet replayed (the lag); read when the status is.
    pub pending_changes: u64,
    /// When the map flipped (clock ms), from `cleaning` on.
    pub cutover_ms: Option<i64>,
    /// The last error the mover met (it stops there; run it again to resume).
    pub error: Option<String>,
    /// How many times a mover took the move (`run`, `abort`): the fencing
    /// token of its current or last mover. A mover whose generation is not
    /// the newest is refused by every shard it writes.
    pub generation: i64,
}

/// What a running move reports to [`Rebalance::on_progress`].
#[derive(Clone, Debug)]
pub struct MoveProgress {
    /// The move.
    pub id: i64,
    /// Its phase.
    pub phase: MovePhase,
    /// Rows copied so far.
    pub rows_copied: u64,
    /// Copy rate since this run started.
    pub rows_per_sec: f64,
    /// Rows of the moving buckets the sources held at the start of the copy
    /// (an estimate: the sources' row counts times the moving share).
    pub rows_estimated: u64,
    /// Logged keys not yet replayed.
    pub pending_changes: u64,
    /// Time the copy still needs at the current rate.
    pub eta: Option<Duration>,
}

type ProgressFn = Arc<dyn Fn(&MoveProgress) + Send + Sync>;

/// Bucket moves of group `G` ([`Cluster::rebalance`](crate::Cluster::rebalance)).
///
/// List every entity of the group with [`entity`](Self::entity), each
/// after the entities its foreign keys point at (customers before their
/// orders): a move copies, replays and deletes the rows of the entities it
/// knows, writing parents first and deleting children first, and is
/// refused without any.
pub struct Rebalance<G> {
    group: &'static str,
    shards: Shards,
    entities: Vec<Arc<dyn MoveEntity>>,
    progress: Option<ProgressFn>,
    wait_for_grace: bool,
    stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// This mover's name in `shardkit_moves.runner` while it holds a move.
    token: String,
    _group: std::marker::PhantomData<fn() -> G>,
}

impl<G> std::fmt::Debug for Rebalance<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rebalance")
            .field("group", &self.group)
            .field(
                "entities",
                &self.entities.iter().map(|e| e.table()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn refused(id: Option<i64>, reason: impl Into<String>) -> impl FnOnce(&str) -> ShardError {
    let reason = reason.into();
    move |group| ShardError::Rebalance {
        group: group.to_owned(),
        id,
        reason,
    }
}

/// The group of a [`Rebalance`] built by name (the operator's command
/// line), whose entities come as objects.
#[derive(Debug)]
pub enum AnyGroup {}

impl Rebalance<AnyGroup> {
    /// Moves of the group named `group`, carrying `entities`.
    #[cfg(feature = "cli")]
    pub(crate) fn named(
        shards: Shards,
        group: &'static str,
        entities: Vec<Arc<dyn MoveEntity>>,
    ) -> Self {
        Rebalance {
            group,
            shards,
            entities,
            progress: None,
            wait_for_grace: false,
            stop: None,
            token: crate::uuid_v7().to_string(),
            _group: std::marker::PhantomData,
        }
    }
}

impl<G: EntityGroup> Rebalance<G> {
    pub(crate) fn new(shards: Shards) -> Self {
        Rebalance {
            group: G::NAME,
            stop: None,
            token: crate::uuid_v7().to_string(),
            shards,
            entities: Vec::new(),
            progress: None,
            wait_for_grace: false,
            _group: std::marker::PhantomData,
        }
    }

    /// Adds an entity of the group to what moves carry.
    pub fn entity<E>(mut self) -> Self
    where
        E: ShardedEntity<Group = G>,
        E::Model: IntoActiveModel<E::ActiveModel> + Sync,
        E::ActiveModel: Send,
    {
        if !self.entities.iter().any(|e| e.table() == table_name::<E>()) {
            self.entities.push(Arc::new(Mover::<E>::new()));
        }
        self
    }
}

impl<G> Rebalance<G> {
    /// Stops [`run`](Self::run) at the next chunk boundary (or phase
    /// boundary) once `flag` is set; run it again to resume.
    pub fn stop_on(mut self, flag: Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.stop = Some(flag);
        self
    }

    fn stopping(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Calls `f` at every phase change, after every run of copied chunks and
    /// after every replay round.
    pub fn on_progress(mut self, f: impl Fn(&MoveProgress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Makes [`run`](Self::run) wait out the cleanup grace period (sleeping)
    /// instead of returning in `cleaning`.
    pub fn wait_for_grace(mut self, wait: bool) -> Self {
        self.wait_for_grace = wait;
        self
    }

    fn refuse(&self, id: Option<i64>, reason: impl Into<String>) -> ShardError {
        refused(id, reason)(self.group)
    }

    fn map(&self) -> Result<LiveMap<'_>> {
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
    async fn moving(&self, ids: &[u32]) -> Result<Buckets> {
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
                    super::refresh(&self.shards, self.group).await?;
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

    fn shard_id(&self, name: &str) -> Result<ShardId> {
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

    /// A plan that moves `buckets` to shard `to`, each from its owner in
    /// the current map (read from the database first).
    pub async fn plan_buckets(
        &self,
        buckets: impl IntoIterator<Item = u32>,
        to: &str,
    ) -> Result<MovePlan> {
        let map = self.map()?;
        super::refresh(&self.shards, self.group).await?;
        let snapshot = map.snapshot();
        let target = self.shard_id(to)?;
        let mut out = Vec::new();
        for b in buckets {
            let Some(from) = snapshot.owner(b) else {
                return Err(self.refuse(
                    None,
                    match snapshot {
                        MapSnapshot::Buckets(all) => format!(
                            "bucket {b} is out of range: the group has {} buckets",
                            all.len()
                        ),
                        MapSnapshot::Ranges(units) => format!(
                            "no range has id {b}; the group's ranges: {}",
                            units
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    },
                ));
            };
            if from == target {
                return Err(self.refuse(None, format!("bucket {b} is already on `{to}`")));
            }
            out.push((b, self.shards.shard_name(from).to_owned()));
        }
        out.sort();
        out.dedup();
        if out.is_empty() {
            return Err(self.refuse(None, "the plan moves no bucket"));
        }
        Ok(MovePlan {
            group: self.group.to_owned(),
            target: to.to_owned(),
            buckets: out,
        })
    }

    /// The fewest bucket moves that give shard `to` (a shard the map does
    /// not use yet, or one with fewer buckets) its even share: the owners
    /// with the most buckets give their last ones until every shard holds
    /// `buckets / shards` or one more.
    pub async fn plan_even_out(&self, to: &str) -> Result<MovePlan> {
        let LiveMap::Buckets(owners) = self.map()? else {
            return Err(self.refuse(
                None,
                "a range group is evened out by splitting ranges (`split_at`) and moving them (`plan_range`)",
            ));
        };
        let count = owners.len() as u32;
        super::refresh(&self.shards, self.group).await?;
        let target = self.shard_id(to)?;
        let map = owners.to_vec();
        let mut held: std::collections::BTreeMap<ShardId, Vec<u32>> = Default::default();
        held.entry(target).or_default();
        for (b, s) in map.iter().enumerate() {
            held.entry(*s).or_default().push(b as u32);
        }
        let share = count as usize / held.len();
        let mut moving = Vec::new();
        let mut have = held[&target].len();
        while have < share {
            // The shard holding the most buckets gives its highest one.
            let (_, buckets) = held
                .iter_mut()
                .filter(|(s, _)| **s != target)
                .max_by_key(|(s, b)| (b.len(), std::cmp::Reverse(**s)))
                .expect("another shard");
            let Some(b) = buckets.pop() else { break };
            moving.push(b);
            have += 1;
        }
        self.plan_buckets(moving, to).await
    }

    fn control(&self) -> Result<(&DatabaseConnection, &str)> {
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
        if self.entities.is_empty() {
            return Err(self.refuse(
                None,
                "no entity listed: add every entity of the group with `.entity::<E>()`",
            ));
        }
        self.shard_id(&plan.target)?;
        // The plan must name each bucket's owner now (another move may have
        // finished since it was made).
        super::refresh(&self.shards, self.group).await?;
        if let LiveMap::Ranges(_) = map {
            // A split's old range must be fenced on its shard before any
            // half moves (a split that stopped before fencing it is
            // finished here).
            self.retire_split_ranges().await?;
        }
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
        let (db, name) = self.control()?;
        let err = |e| db_err(name, MOVES, "register", e);
        let txn = crate::exec::begin_write(db).await.map_err(err)?;
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

    /// Every move of the group that is not finished, and the finished ones
    /// too when `all`.
    pub async fn list(&self, all: bool) -> Result<Vec<MoveStatus>> {
        let (db, name) = self.control()?;
        let mut select = Query::select();
        select
            .column(Alias::new("id"))
            .from(Alias::new(MOVES))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group));
        if !all {
            select.and_where(
                Expr::col(Alias::new("phase"))
                    .is_not_in([MovePhase::Done.as_str(), MovePhase::Aborted.as_str()]),
            );
        }
        select.order_by(Alias::new("id"), sea_orm::sea_query::Order::Asc);
        let rows = db
            .query_all(&select)
            .await
            .map_err(|e| db_err(name, MOVES, "read", e))?;
        let mut out = Vec::new();
        for row in rows {
            let id: i64 = row
                .try_get("", "id")
                .map_err(|e| db_err(name, MOVES, "read", e))?;
            out.push(self.status(id).await?);
        }
        Ok(out)
    }

    /// Move `id` as stored, with its pending changes counted.
    pub async fn status(&self, id: i64) -> Result<MoveStatus> {
        let mut status = self.read(id).await?.0;
        if !status.phase.is_finished() {
            status.pending_changes = self.pending(&status).await?;
        }
        Ok(status)
    }

    async fn read(&self, id: i64) -> Result<(MoveStatus, Option<String>)> {
        let (db, name) = self.control()?;
        let err = |e| db_err(name, MOVES, "read", e);
        let stmt = Query::select()
            .columns(
                [
                    "grp",
                    "target",
                    "buckets",
                    "phase",
                    "cursor",
                    "rows_copied",
                    "changes_applied",
                    "cutover_ms",
                    "error",
                    "tables",
                    "generation",
                ]
                .map(Alias::new),
            )
            .from(Alias::new(MOVES))
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .to_owned();
        let row = db
            .query_one(&stmt)
            .await
            .map_err(err)?
            .ok_or_else(|| self.refuse(Some(id), "no such move"))?;
        let group: String = row.try_get("", "grp").map_err(err)?;
        if group != self.group {
            return Err(self.refuse(Some(id), format!("the move is of group `{group}`")));
        }
        let tables: String = row.try_get("", "tables").map_err(err)?;
        if tables != self.tables() {
            return Err(self.refuse(
                Some(id),
                format!(
                    "the move carries the tables [{tables}] in this order, this mover lists [{}]: list the same entities in the same order",
                    self.tables()
                ),
            ));
        }
        let phase: String = row.try_get("", "phase").map_err(err)?;
        let buckets: String = row.try_get("", "buckets").map_err(err)?;
        let buckets = buckets
            .split(',')
            .filter_map(|p| {
                let (b, s) = p.split_once(':')?;
                Some((b.parse().ok()?, s.to_owned()))
            })
            .collect();
        let status = MoveStatus {
            id,
            group,
            target: row.try_get("", "target").map_err(err)?,
            buckets,
            phase: MovePhase::parse(&phase)
                .ok_or_else(|| self.refuse(Some(id), format!("unknown phase {phase:?}")))?,
            rows_copied: row.try_get::<i64>("", "rows_copied").map_err(err)? as u64,
            changes_applied: row.try_get::<i64>("", "changes_applied").map_err(err)? as u64,
            pending_changes: 0,
            cutover_ms: row.try_get("", "cutover_ms").map_err(err)?,
            error: row.try_get("", "error").map_err(err)?,
            generation: row.try_get("", "generation").map_err(err)?,
        };
        Ok((status, row.try_get("", "cursor").map_err(err)?))
    }

    async fn save(
        &self,
        token: &Token,
        status: &MoveStatus,
        cursor: Option<&str>,
        extra: impl FnOnce(&mut sea_orm::sea_query::UpdateStatement),
    ) -> Result<()> {
        let (db, name) = self.control()?;
        let mut stmt = Query::update();
        stmt.table(Alias::new(MOVES))
            .value(Alias::new("phase"), status.phase.as_str())
            .value(Alias::new("cursor"), cursor.map(str::to_owned))
            .value(Alias::new("rows_copied"), status.rows_copied as i64)
            .value(Alias::new("changes_applied"), status.changes_applied as i64)
            .value(Alias::new("updated_ms"), self.shards.now_ms())
            .value(Alias::new("error"), status.error.clone())
            .value(Alias::new("lease_ms"), self.shards.now_ms() + LEASE_MS)
            .and_where(Expr::col(Alias::new("id")).eq(status.id))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()));
        extra(&mut stmt);
        let saved = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "update", e))?
            .rows_affected();
        if saved != 1 {
            return Err(self.refuse(
                Some(status.id),
                "another process took the move over (this mover was silent past its hold); this mover stops",
            ));
        }
        Ok(())
    }

    /// The entities' tables as the move stores them.
    fn tables(&self) -> String {
        self.entities
            .iter()
            .map(|e| e.table())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Takes move `id` for this mover: refused while another runner's hold
    /// lasts. Raises the move's generation and installs it on every shard
    /// the move touches before anything is written there, so a mover that
    /// held the move before is refused from then on. Returns `None` when the
    /// move is finished.
    async fn acquire(&self, id: i64) -> Result<Option<Token>> {
        let (db, name) = self.control()?;
        let now = self.shards.now_ms();
        let stmt = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("runner"), self.token.as_str())
            .value(Alias::new("lease_ms"), now + LEASE_MS)
            .value(
                Alias::new("generation"),
                Expr::col(Alias::new("generation")).add(1),
            )
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(
                Expr::col(Alias::new("phase"))
                    .is_not_in([MovePhase::Done.as_str(), MovePhase::Aborted.as_str()]),
            )
            .cond_where(
                Condition::any()
                    .add(Expr::col(Alias::new("runner")).is_null())
                    .add(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
                    .add(Expr::col(Alias::new("lease_ms")).lt(now)),
            )
            .to_owned();
        let took = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "take", e))?
            .rows_affected();
        if took != 1 {
            let (status, _) = self.read(id).await?;
            if status.phase.is_finished() {
                return Ok(None);
            }
            return Err(self.refuse(
                Some(id),
                format!(
                    "another process is running the move (it is {}); it stops with Ctrl-C, or its hold lapses {} s after its last step if it died",
                    status.phase,
                    LEASE_MS / 1000
                ),
            ));
        }
        match self.fence_shards(id).await {
            Ok(token) => Ok(Some(token)),
            Err(e) => {
                self.let_go(id, None).await;
                Err(e)
            }
        }
    }

    /// Installs the generation this mover took move `id` at on every shard
    /// the move writes.
    async fn fence_shards(&self, id: i64) -> Result<Token> {
        let (status, _) = self.read(id).await?;
        let target = self.shard_id(&status.target)?;
        let token = Token::new(
            &self.shards,
            self.group,
            id,
            status.generation,
            target,
            Duration::from_millis(LEASE_MS as u64),
        );
        // Every shard the move writes: the sources, the target, and the
        // control database (its claims).
        let mut shards: Vec<ShardId> = self.sources(&status)?.into_iter().map(|(s, _)| s).collect();
        shards.push(target);
        shards.push(control(&self.shards, self.group)?);
        shards.sort();
        shards.dedup();
        // A paused mover's open transaction ends by the server's idle
        // timeout, which is the hold's length.
        let wait = Duration::from_millis(LEASE_MS as u64) + Duration::from_secs(5);
        for shard in shards {
            let (db, name) = self.conn(shard);
            self.timed(name, token.install((db, name), wait)).await?;
        }
        tracing::debug!(
            group = self.group,
            id,
            generation = token.generation(),
            "move taken"
        );
        Ok(token)
    }

    /// Runs `work` while renewing this mover's hold every third of the
    /// hold's length; stops it when the hold was lost (another process took
    /// the move over).
    async fn holding<T>(
        &self,
        token: &Token,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let beat = async {
            loop {
                tokio::time::sleep(Duration::from_millis(LEASE_MS as u64 / 3)).await;
                if token.parked() {
                    // A paused process renews nothing.
                    continue;
                }
                match self.renew(token).await {
                    Ok(true) => {}
                    Ok(false) => {
                        return self.refuse(
                            Some(token.id()),
                            "another process took the move over (this mover was silent past its hold); this mover stops",
                        );
                    }
                    Err(e) => {
                        tracing::warn!(group = self.group, id = token.id(), error = %e.report(), "could not renew the hold on the move; trying again");
                    }
                }
            }
        };
        tokio::pin!(work);
        tokio::select! {
            biased;
            done = &mut work => done,
            lost = beat => Err(lost),
        }
    }

    /// Renews this mover's hold; `false` when another process holds the
    /// move now.
    async fn renew(&self, token: &Token) -> Result<bool> {
        let (db, name) = self.control()?;
        let stmt = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("lease_ms"), self.shards.now_ms() + LEASE_MS)
            .and_where(Expr::col(Alias::new("id")).eq(token.id()))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()))
            .to_owned();
        let renewed = db
            .execute(&stmt)
            .await
            .map_err(|e| db_err(name, MOVES, "renew", e))?
            .rows_affected();
        Ok(renewed == 1)
    }

    /// Lets go of move `id` (held at `generation`, when known).
    async fn let_go(&self, id: i64, generation: Option<i64>) {
        let Ok((db, _)) = self.control() else { return };
        let mut stmt = Query::update();
        stmt.table(Alias::new(MOVES))
            .value(Alias::new("runner"), Option::<String>::None)
            .value(Alias::new("lease_ms"), Option::<i64>::None)
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()));
        if let Some(g) = generation {
            stmt.and_where(Expr::col(Alias::new("generation")).eq(g));
        }
        if let Err(e) = db.execute(&stmt).await {
            tracing::warn!(group = self.group, id, error = %e, "could not let go of the move (its hold lapses by itself)");
        }
    }

    async fn set_phase(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        phase: MovePhase,
    ) -> Result<()> {
        status.phase = phase;
        self.save(token, status, None, |_| {}).await?;
        crate::metrics::move_phase(
            self.group,
            MovePhase::ALL.iter().position(|p| *p == phase).unwrap_or(0) as u8,
        );
        tracing::info!(group = self.group, id = status.id, phase = %phase, "move phase");
        if let Some(f) = &self.progress {
            f(&MoveProgress {
                id: status.id,
                phase,
                rows_copied: status.rows_copied,
                rows_per_sec: 0.0,
                rows_estimated: status.rows_copied,
                pending_changes: status.pending_changes,
                eta: None,
            });
        }
        Ok(())
    }

    /// The sources, each with the moving buckets it gives.
    fn sources(&self, status: &MoveStatus) -> Result<Vec<(ShardId, Vec<u32>)>> {
        let mut by: std::collections::BTreeMap<ShardId, Vec<u32>> = Default::default();
        for (b, s) in &status.buckets {
            by.entry(self.shard_id(s)?).or_default().push(*b);
        }
        Ok(by.into_iter().collect())
    }

    /// Fault injection: `shardkit::rebalance::<step>` fails the mover at
    /// that step when its argument is part of the target database's URL
    /// (any move, without one).
    #[allow(unused_variables)]
    fn failpoint(&self, step: &str, id: i64, target: ShardId) -> Result<()> {
        #[cfg(feature = "failpoints")]
        if fail::eval(&format!("shardkit::rebalance::{step}"), |arg| {
            arg.unwrap_or_default()
        })
        .is_some_and(|arg| {
            self.shards
                .topology()
                .shard(target)
                .url
                .expose()
                .contains(arg.as_str())
        }) {
            return Err(self.refuse(Some(id), format!("failpoint shardkit::rebalance::{step}")));
        }
        Ok(())
    }

    /// `work` (one step against `shard`) bounded by `[rebalance]
    /// step_timeout_ms`: a shard that stops answering fails the mover
    /// instead of holding it; run the move again when the shard is back.
    async fn timed<T>(
        &self,
        shard: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let step = self.shards.rebalance_settings().step_timeout;
        super::entity::bounded(self.group, step, shard, work).await
    }

    fn conn(&self, id: ShardId) -> (&DatabaseConnection, &str) {
        (self.shards.side_conn(id), self.shards.shard_name(id))
    }

    async fn pending(&self, status: &MoveStatus) -> Result<u64> {
        let mut total = 0u64;
        for (src, _) in self.sources(status)? {
            let (db, name) = self.conn(src);
            let stmt = Query::select()
                .expr_as(Expr::col(Alias::new("seq")).count(), Alias::new("n"))
                .from(Alias::new(CHANGES))
                .and_where(Expr::col(Alias::new("move_id")).eq(status.id))
                .to_owned();
            let n: i64 = db
                .query_one(&stmt)
                .await
                .map_err(|e| db_err(name, CHANGES, "read", e))?
                .and_then(|r| r.try_get("", "n").ok())
                .unwrap_or(0);
            total += n as u64;
        }
        Ok(total)
    }

    /// Makes the target's rows of `keys` what the source holds now: every
    /// entity's rows written (parents first), then the rows the source no
    /// longer has deleted (children first), all read in one snapshot of the
    /// source (writers that add a parent and its children meanwhile would
    /// otherwise hand the target a child without its parent).
    async fn sync_keys(
        &self,
        token: &Token,
        source: (&DatabaseConnection, &str),
        target: (&DatabaseConnection, &str),
        keys: &[String],
    ) -> Result<()> {
        let err = |e| db_err(source.1, CHANGES, "read a snapshot of", e);
        let snapshot = match source.0.get_database_backend() {
            // A deferred transaction reads one snapshot (WAL).
            DbBackend::Sqlite => sea_orm::TransactionTrait::begin(source.0).await,
            _ => {
                sea_orm::TransactionTrait::begin_with_config(
                    source.0,
                    Some(sea_orm::IsolationLevel::RepeatableRead),
                    Some(sea_orm::AccessMode::ReadOnly),
                )
                .await
            }
        }
        .map_err(err)?;
        let src = (&snapshot, source.1);
        for entity in &self.entities {
            self.timed(target.1, entity.upsert_keys(token, src, target, keys))
                .await?;
        }
        for entity in self.entities.iter().rev() {
            self.timed(target.1, entity.prune_keys(token, src, target, keys))
                .await?;
        }
        snapshot.rollback().await.map_err(err)
    }

    /// Replays up to `limit` logged keys per source (all of them when
    /// `None`); returns how many log entries it consumed.
    async fn replay(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        limit: Option<u64>,
    ) -> Result<u64> {
        let target = self.conn(self.shard_id(&status.target)?);
        let mut consumed = 0u64;
        for (src, _) in self.sources(status)? {
            let source = self.conn(src);
            let (db, name) = source;
            let err = |e| db_err(name, CHANGES, "replay", e);
            let mut done_here = 0u64;
            loop {
                let batch = limit.map_or(1_000, |l| Ord::min(l.saturating_sub(done_here), 1_000));
                if batch == 0 {
                    break;
                }
                let stmt = Query::select()
                    .columns([Alias::new("seq"), Alias::new("key_text")])
                    .from(Alias::new(CHANGES))
                    .and_where(Expr::col(Alias::new("move_id")).eq(status.id))
                    .order_by(Alias::new("seq"), sea_orm::sea_query::Order::Asc)
                    .limit(batch)
                    .to_owned();
                let rows = db.query_all(&stmt).await.map_err(err)?;
                if rows.is_empty() {
                    break;
                }
                let mut seqs = Vec::with_capacity(rows.len());
                let mut keys = Vec::with_capacity(rows.len());
                for row in &rows {
                    seqs.push(row.try_get::<i64>("", "seq").map_err(err)?);
                    keys.push(row.try_get::<String>("", "key_text").map_err(err)?);
                }
                keys.sort();
                keys.dedup();
                self.sync_keys(token, source, target, &keys).await?;
                let delete = Query::delete()
                    .from_table(Alias::new(CHANGES))
                    .and_where(Expr::col(Alias::new("seq")).is_in(seqs.iter().copied()))
                    .to_owned();
                let txn = token.begin(source, "log").await?;
                txn.execute(&delete).await.map_err(err)?;
                txn.commit().await.map_err(err)?;
                let n = seqs.len() as u64;
                done_here += n;
                consumed += n;
                status.changes_applied += keys.len() as u64;
                crate::metrics::move_applied(self.group, keys.len() as u64);
                if (n as u64) < batch {
                    break;
                }
            }
        }
        Ok(consumed)
    }

    fn report(&self, status: &MoveStatus, started: (i64, u64), estimated: u64, pending: u64) {
        let elapsed_ms = Ord::max(self.shards.now_ms() - started.0, 1) as f64;
        let rate = (status.rows_copied.saturating_sub(started.1)) as f64 * 1000.0 / elapsed_ms;
        let eta = (rate > 0.0 && estimated > status.rows_copied)
            .then(|| Duration::from_secs_f64((estimated - status.rows_copied) as f64 / rate));
        crate::metrics::move_pending(self.group, pending);
        tracing::debug!(group = self.group, id = status.id, phase = %status.phase, rows = status.rows_copied, rate, pending, "move progress");
        if let Some(f) = &self.progress {
            f(&MoveProgress {
                id: status.id,
                phase: status.phase,
                rows_copied: status.rows_copied,
                rows_per_sec: rate,
                rows_estimated: estimated,
                pending_changes: pending,
                eta,
            });
        }
    }

    /// Runs move `id` from its stored phase as far as it can go: to `done`,
    /// or to `cleaning` when the grace period has not passed (unless
    /// [`wait_for_grace`](Self::wait_for_grace)). Run it again, from any
    /// process, to resume a move whose mover stopped or failed.
    ///
    /// One process runs a move at a time: another `run` or `abort` of it is
    /// refused while this one holds it (it lets go when it returns, and its
    /// hold lapses 30 s after its last step if the process dies).
    pub async fn run(&self, id: i64) -> Result<MoveStatus> {
        if self.entities.is_empty() {
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
        if self.entities.is_empty() {
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
            if self.stopping() && status.phase != MovePhase::CuttingOver {
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
                                            settings.chunk,
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
                                            table = entity.table(),
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
                                if after.is_none() {
                                    break;
                                }
                                if self.stopping() {
                                    return self.status(id).await;
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
                        let n = self.replay(token, &mut status, Some(CATCH_UP)).await?;
                        let pending = self.pending(&status).await?;
                        self.save(token, &status, None, |_| {}).await?;
                        self.report(&status, started, estimated, pending);
                        if n < 10_000 && pending < 1_000 {
                            break;
                        }
                    }
                    self.compare(token, &mut status, target, settings.chunk)
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
                    let due = status.cutover_ms.unwrap_or_default()
                        + settings.cleanup_grace.as_millis() as i64;
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
                    format!("SELECT COUNT(*) AS n FROM {}", quote(db, entity.table())),
                );
                let n: i64 = db
                    .query_one_raw(stmt)
                    .await
                    .map_err(|e| db_err(name, entity.table(), "count", e))?
                    .and_then(|r| r.try_get("", "n").ok())
                    .unwrap_or(0);
                total += n as u64 * buckets.len() as u64 / owned.max(1) as u64;
            }
        }
        Ok(total)
    }

    /// Compares every moving bucket's rows; a key that differs and has no
    /// logged change pending is copied again and compared again.
    async fn compare(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
        chunk: u64,
    ) -> Result<()> {
        let dst = self.conn(target);
        for (src, buckets) in self.sources(status)? {
            let only_here = self.moving(&buckets).await?;
            let source = self.conn(src);
            let step = self.shards.rebalance_settings().step_timeout;
            for entity in &self.entities {
                let compare = || entity.compare(source, dst, chunk, &only_here, step);
                let found = compare().await?;
                if found.keys.is_empty() {
                    continue;
                }
                let pending = self.pending_keys(source, status.id).await?;
                let unexplained: Vec<String> = found
                    .keys
                    .into_iter()
                    .filter(|k| !pending.contains(k))
                    .collect();
                if unexplained.is_empty() {
                    continue;
                }
                tracing::warn!(
                    group = self.group,
                    id = status.id,
                    table = entity.table(),
                    keys = unexplained.len(),
                    "rows differ without a logged change: copying them again"
                );
                self.sync_keys(token, source, dst, &unexplained).await?;
                let again = compare().await?;
                let pending = self.pending_keys(source, status.id).await?;
                let still = again.keys.iter().filter(|k| !pending.contains(*k)).count();
                if still > 0 {
                    return Err(self.refuse(
                        Some(status.id),
                        format!("{still} keys of `{}` still differ between `{}` and `{}` after copying them again: something writes the source without shardkit", entity.table(), source.1, dst.1),
                    ));
                }
            }
        }
        Ok(())
    }

    async fn pending_keys(
        &self,
        source: (&DatabaseConnection, &str),
        id: i64,
    ) -> Result<std::collections::HashSet<String>> {
        let stmt = Query::select()
            .column(Alias::new("key_text"))
            .from(Alias::new(CHANGES))
            .and_where(Expr::col(Alias::new("move_id")).eq(id))
            .to_owned();
        let rows = source
            .0
            .query_all(&stmt)
            .await
            .map_err(|e| db_err(source.1, CHANGES, "read", e))?;
        Ok(rows
            .iter()
            .filter_map(|r| r.try_get::<String>("", "key_text").ok())
            .collect())
    }

    async fn cut_over(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        target: ShardId,
        settings: &crate::exec::RebalanceSettings,
    ) -> Result<()> {
        let id = status.id;
        self.failpoint("cutting_over", id, target)?;
        let sources = self.sources(status)?;
        // Catch up first, so what is replayed behind the fence (while the
        // moving buckets' writes wait) is only what came in since.
        for _ in 0..10 {
            let n = self.replay(token, status, Some(CATCH_UP)).await?;
            if n < 100 {
                break;
            }
        }
        // Fence every source. Each update waits for the transactions that
        // read the bucket's state before it; one that waits too long gives
        // up, the writes it held back go on, and the mover catches up and
        // tries again.
        let mut attempt = 0;
        for (src, buckets) in &sources {
            let (db, name) = self.conn(*src);
            loop {
                match set_states(
                    Some(token),
                    (db, name),
                    self.group,
                    buckets,
                    &[BucketState::Moving, BucketState::Moved],
                    BucketState::Moved,
                    Some(id),
                    Some(settings.cutover_wait),
                )
                .await
                {
                    Ok(n) if n == buckets.len() as u64 => break,
                    Ok(n) => {
                        return Err(self.refuse(
                            Some(id),
                            format!(
                                "only {n} of the {} buckets moving away from `{name}` were in this move's hands there: was the move aborted meanwhile?",
                                buckets.len()
                            ),
                        ));
                    }
                    // A lock wait that ran out (PostgreSQL's lock_timeout,
                    // MySQL's lock wait timeout, SQLite's busy timeout).
                    Err(e) if attempt < 20 && e.kind() == crate::ErrorKind::Database => {
                        attempt += 1;
                        tracing::debug!(group = self.group, id, attempt, error = %e.report(), "fence waited too long; catching up and trying again");
                        // Bounded: the writers go on meanwhile, so the log
                        // never empties under a steady load.
                        self.replay(token, status, Some(CATCH_UP)).await?;
                    }
                    Err(e) => {
                        // Writes of the buckets fenced so far go on until
                        // the move is run again.
                        for (src, buckets) in &sources {
                            let _ = set_states(
                                Some(token),
                                self.conn(*src),
                                self.group,
                                buckets,
                                &[BucketState::Moved],
                                BucketState::Moving,
                                Some(id),
                                None,
                            )
                            .await;
                        }
                        return Err(e);
                    }
                }
            }
        }
        self.failpoint("fenced", id, target)?;
        // No write of the moving buckets can commit on a source now.
        self.replay(token, status, None).await?;
        let (db, name) = self.conn(target);
        let all: Vec<u32> = status.buckets.iter().map(|(b, _)| *b).collect();
        // `moved`: the target gave these buckets away in an earlier move.
        let owned = set_states(
            Some(token),
            (db, name),
            self.group,
            &all,
            &[BucketState::None, BucketState::Owned, BucketState::Moved],
            BucketState::Owned,
            None,
            None,
        )
        .await?;
        if owned != all.len() as u64 {
            return Err(self.refuse(
                Some(id),
                format!(
                    "shard `{name}` has state rows for {owned} of the {} moving buckets: connect an instance with this configuration (it seeds them) and run the move again",
                    all.len()
                ),
            ));
        }
        // Flip the map and end the phase in one transaction.
        let (cdb, cname) = self.control()?;
        let err = |e| db_err(cname, super::map::MAP, "cut over", e);
        let txn = crate::exec::begin_write(cdb).await.map_err(err)?;
        for chunk in all.chunks(500) {
            let stmt = Query::update()
                .table(Alias::new(super::map::MAP))
                .value(Alias::new("shard"), status.target.clone())
                .and_where(Expr::col(Alias::new("grp")).eq(self.group))
                .and_where(Expr::col(Alias::new("bucket")).is_in(chunk.iter().map(|b| *b as i32)))
                .to_owned();
            txn.execute(&stmt).await.map_err(err)?;
        }
        let bump = Query::update()
            .table(Alias::new(super::map::EPOCHS))
            .value(Alias::new("epoch"), Expr::col(Alias::new("epoch")).add(1))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .to_owned();
        txn.execute(&bump).await.map_err(err)?;
        let now = self.shards.now_ms();
        let phase = Query::update()
            .table(Alias::new(MOVES))
            .value(Alias::new("phase"), MovePhase::Cleaning.as_str())
            .value(Alias::new("cutover_ms"), now)
            .value(Alias::new("changes_applied"), status.changes_applied as i64)
            .value(Alias::new("updated_ms"), now)
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .and_where(Expr::col(Alias::new("phase")).eq(MovePhase::CuttingOver.as_str()))
            .and_where(Expr::col(Alias::new("runner")).eq(self.token.as_str()))
            .and_where(Expr::col(Alias::new("generation")).eq(token.generation()))
            .to_owned();
        if txn.execute(&phase).await.map_err(err)?.rows_affected() != 1 {
            // Rolled back with the map unchanged.
            return Err(self.refuse(
                Some(id),
                "the move is no longer this mover's to cut over (aborted, or taken over after a lapsed hold)",
            ));
        }
        txn.commit().await.map_err(err)?;
        status.phase = MovePhase::Cleaning;
        status.cutover_ms = Some(now);
        crate::metrics::move_pending(self.group, 0);
        if let Some(f) = &self.progress {
            f(&MoveProgress {
                id,
                phase: MovePhase::Cleaning,
                rows_copied: status.rows_copied,
                rows_per_sec: 0.0,
                rows_estimated: status.rows_copied,
                pending_changes: 0,
                eta: None,
            });
        }
        let epoch = super::refresh(&self.shards, self.group).await?;
        tracing::info!(group = self.group, id, epoch, "move cut over");
        Ok(())
    }

    async fn clean(
        &self,
        token: &Token,
        status: &mut MoveStatus,
        cursor: Option<String>,
    ) -> Result<()> {
        let chunk = self.shards.rebalance_settings().chunk;
        let sources = self.sources(status)?;
        let (mut si, mut ei, mut after) = parse_copy_cursor(cursor.as_deref());
        while si < sources.len() {
            let (src, buckets) = &sources[si];
            let only_here = self.moving(buckets).await?;
            while ei < self.entities.len() {
                loop {
                    // Children first (the entities in reverse order).
                    let entity = &self.entities[self.entities.len() - 1 - ei];
                    let done = self
                        .timed(
                            self.shards.shard_name(*src),
                            entity.delete_chunk(
                                token,
                                self.conn(*src),
                                after.as_deref(),
                                chunk,
                                &only_here,
                            ),
                        )
                        .await?;
                    after = done.next;
                    let c = copy_cursor(si, ei, after.as_deref());
                    self.save(token, status, Some(&c), |_| {}).await?;
                    if after.is_none() {
                        break;
                    }
                }
                ei += 1;
            }
            // The log is empty since the cut-over; drop what an abort or
            // crash left.
            let (db, name) = self.conn(*src);
            self.drop_log(token, (db, name), "clean").await?;
            // The source neither owns nor fences these buckets any more in
            // its own name: `none` refuses their writes all the same, and a
            // later move may bring them back.
            set_states(
                Some(token),
                (db, name),
                self.group,
                buckets,
                &[BucketState::Moved],
                BucketState::None,
                None,
                None,
            )
            .await?;
            si += 1;
            ei = 0;
        }
        self.release_buckets(token, status.id).await
    }

    /// Drops the move's change log on one source, under the fence.
    async fn drop_log(
        &self,
        token: &Token,
        (db, name): (&DatabaseConnection, &str),
        what: &str,
    ) -> Result<()> {
        let err = |e| db_err(name, CHANGES, what, e);
        let delete = Query::delete()
            .from_table(Alias::new(CHANGES))
            .and_where(Expr::col(Alias::new("move_id")).eq(token.id()))
            .to_owned();
        let txn = token.begin((db, name), "log").await?;
        txn.execute(&delete).await.map_err(err)?;
        txn.commit().await.map_err(err)
    }

    async fn release_buckets(&self, token: &Token, id: i64) -> Result<()> {
        let (db, name) = self.control()?;
        let err = |e| db_err(name, CLAIMS, "release", e);
        let stmt = Query::delete()
            .from_table(Alias::new(CLAIMS))
            .and_where(Expr::col(Alias::new("move_id")).eq(id))
            .to_owned();
        let txn = token.begin((db, name), "release").await?;
        txn.execute(&stmt).await.map_err(err)?;
        txn.commit().await.map_err(err)
    }

    /// Aborts move `id` before its cut-over: the sources own the buckets
    /// again (their writes stop being logged), the target's copies are
    /// deleted and the buckets are released. Refused from `cleaning` on
    /// (the target owns the buckets: move them back instead). Stop the
    /// move's mover first.
    pub async fn abort(&self, id: i64) -> Result<MoveStatus> {
        self.map()?;
        let Some(token) = self.acquire(id).await? else {
            let (status, _) = self.read(id).await?;
            return match status.phase {
                MovePhase::Aborted => self.status(id).await,
                _ => Err(self.refuse(
                    Some(id),
                    format!("the move is {}: the target owns the buckets; move them back with a new move", status.phase),
                )),
            };
        };
        let result = self.holding(&token, self.abort_held(&token, id)).await;
        self.let_go(id, Some(token.generation())).await;
        result
    }

    async fn abort_held(&self, token: &Token, id: i64) -> Result<MoveStatus> {
        let (mut status, _) = self.read(id).await?;
        match status.phase {
            MovePhase::Aborted => return self.status(id).await,
            MovePhase::Cleaning | MovePhase::Done => {
                return Err(self.refuse(
                    Some(id),
                    format!("the move is {}: the target owns the buckets; move them back with a new move", status.phase),
                ));
            }
            _ => {}
        }
        let target = self.shard_id(&status.target)?;
        let all: Vec<u32> = status.buckets.iter().map(|(b, _)| *b).collect();
        {
            let (db, name) = self.conn(target);
            set_states(
                Some(token),
                (db, name),
                self.group,
                &all,
                &[BucketState::Owned],
                BucketState::None,
                None,
                None,
            )
            .await?;
        }
        for (src, buckets) in self.sources(&status)? {
            let (db, name) = self.conn(src);
            set_states(
                Some(token),
                (db, name),
                self.group,
                &buckets,
                &[BucketState::Moving, BucketState::Moved],
                BucketState::Owned,
                None,
                None,
            )
            .await?;
            self.drop_log(token, (db, name), "abort").await?;
        }
        let moving = self.moving(&all).await?;
        let chunk = self.shards.rebalance_settings().chunk;
        // Children first: a row's foreign keys point at entities listed
        // before it.
        for entity in self.entities.iter().rev() {
            let mut after: Option<String> = None;
            loop {
                let done = self
                    .timed(
                        self.shards.shard_name(target),
                        entity.delete_chunk(
                            token,
                            self.conn(target),
                            after.as_deref(),
                            chunk,
                            &moving,
                        ),
                    )
                    .await?;
                after = done.next;
                if after.is_none() {
                    break;
                }
            }
        }
        self.release_buckets(token, id).await?;
        self.set_phase(token, &mut status, MovePhase::Aborted)
            .await?;
        tracing::info!(group = self.group, id, "move aborted");
        self.status(id).await
    }
}

/// Whether a database refused a row for its foreign key.
fn foreign_key(e: &ShardError) -> bool {
    matches!(e, ShardError::Db { source, .. }
        if matches!(source.sql_err(), Some(sea_orm::SqlErr::ForeignKeyConstraintViolation(_))))
}

/// `<source index>/<entity index>/<primary key>`; past the entity's last
/// chunk, the next entity's start.
fn copy_cursor(si: usize, ei: usize, after: Option<&str>) -> String {
    match after {
        Some(a) => format!("{si}/{ei}/{a}"),
        None => format!("{si}/{}/", ei + 1),
    }
}

fn parse_copy_cursor(text: Option<&str>) -> (usize, usize, Option<String>) {
    let Some(text) = text else {
        return (0, 0, None);
    };
    let mut parts = text.splitn(3, '/');
    let si = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let ei = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let after = parts.next().filter(|p| !p.is_empty()).map(str::to_owned);
    (si, ei, after)
}

fn quote(db: &DatabaseConnection, table: &str) -> String {
    match db.get_database_backend() {
        DbBackend::MySql => format!("`{table}`"),
        _ => format!("\"{table}\""),
    }
}

/// What [`Rebalance::split_at`] did: the range it retired and the two
/// halves that replace it, both on the retired range's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeSplit {
    /// The range that was split (its id is never used again).
    pub retired: RangeUnit,
    /// Keys below the split point.
    pub left: RangeUnit,
    /// Keys from the split point on.
    pub right: RangeUnit,
    /// The map's epoch with the split.
    pub epoch: u64,
    /// Whether the retired range is fenced on its shard already. When not
    /// (the shard did not answer in time), an instance still routing by it
    /// writes there unlogged until the next move start of the group fences
    /// it, which every move start does first.
    pub fenced: bool,
}

/// A claim's `move_id` for a range a split retired and fenced; `0` while
/// it is not fenced yet.
const SPLIT_FENCED: i64 = -1;

impl<G: EntityGroup> Rebalance<G> {
    /// Splits the range holding `key` at `key` (a range group): the two
    /// halves stay on the range's shard, under new ids, and either can then
    /// move ([`plan_range`](Self::plan_range)). No row is copied; writes go
    /// on (an instance that still routes by the old range is refused by its
    /// shard's fence and rerouted). Refused while a move holds the range.
    pub async fn split_at(&self, key: &G::Key) -> Result<RangeSplit> {
        let at = RangeBound::at_key(key).ok_or_else(|| {
            self.refuse(
                None,
                format!("{key:?} cannot bound a range (integer bounds fit i64)"),
            )
        })?;
        self.split_at_bound(at).await
    }

    /// A plan that moves the range holding `key` to shard `to`.
    pub async fn plan_range(&self, key: &G::Key, to: &str) -> Result<MovePlan> {
        let units = self.ranges().await?;
        let i = crate::topology::find_key(&units, key)
            .map_err(|reason| self.refuse(None, format!("{key:?} is in no range: {reason}")))?;
        self.plan_buckets([units[i].id], to).await
    }
}

impl<G> Rebalance<G> {
    /// The group's ranges now (read from the database first), in key order.
    pub async fn ranges(&self) -> Result<Vec<RangeUnit>> {
        let LiveMap::Ranges(ranges) = self.map()? else {
            return Err(self.refuse(None, "a hash group has buckets, not ranges"));
        };
        super::refresh(&self.shards, self.group).await?;
        Ok(ranges.units().to_vec())
    }

    /// A shard key given as text (an integer, a string, a UUID) as a range
    /// bound of the group's key type (what `shardctl` passes on).
    pub fn bound_at(&self, key: &str) -> Result<RangeBound> {
        let entity = self.entities.first().ok_or_else(|| {
            self.refuse(
                None,
                "no entity listed: add the group's entities with `.entity::<E>()`",
            )
        })?;
        entity.bound_at(key).ok_or_else(|| {
            self.refuse(
                None,
                format!("{key:?} is not a shard key of the group's key type"),
            )
        })
    }

    /// [`plan_range`](Self::plan_range) with the key given as a bound.
    pub async fn plan_range_at(&self, at: &RangeBound, to: &str) -> Result<MovePlan> {
        let units = self.ranges().await?;
        let i = find_bound(&units, at)
            .map_err(|reason| self.refuse(None, format!("{at} is in no range: {reason}")))?;
        self.plan_buckets([units[i].id], to).await
    }

    /// [`split_at`](Self::split_at) with the split point given as a bound
    /// (see [`bound_at`](Self::bound_at)). The bound must be of the kind the
    /// group's ranges and listed entities' keys are.
    pub async fn split_at_bound(&self, at: RangeBound) -> Result<RangeSplit> {
        let LiveMap::Ranges(ranges) = self.map()? else {
            return Err(self.refuse(None, "only range groups split; a hash group moves buckets"));
        };
        super::refresh(&self.shards, self.group).await?;
        // The epoch before the ranges: ranges newer than the epoch only
        // fail the epoch check below, never pass it with a stale range.
        let epoch = ranges.epoch();
        let units = ranges.units();
        self.check_kind(&units, &at)?;
        let i = find_bound(&units, &at)
            .map_err(|reason| self.refuse(None, format!("{at} is in no range: {reason}")))?;
        let old = units[i].clone();
        if old.from.as_ref() == Some(&at) {
            return Err(self.refuse(None, format!("{at} already starts {old}")));
        }
        let (db, name) = self.control()?;
        let holder = Query::select()
            .column(Alias::new("move_id"))
            .from(Alias::new(CLAIMS))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(Expr::col(Alias::new("bucket")).eq(old.id as i32))
            .to_owned();
        if let Some(row) = db
            .query_one(&holder)
            .await
            .map_err(|e| db_err(name, CLAIMS, "read", e))?
        {
            let by: i64 = row
                .try_get("", "move_id")
                .map_err(|e| db_err(name, CLAIMS, "read", e))?;
            return Err(self.held(&old, by));
        }
        // 1. Two ids of the group's own, never handed out before.
        let first = self.allocate_range_ids(2).await?;
        let left = RangeUnit {
            id: first,
            from: old.from.clone(),
            to: Some(at.clone()),
            shard: old.shard,
        };
        let right = RangeUnit {
            id: first + 1,
            from: Some(at),
            to: old.to.clone(),
            shard: old.shard,
        };
        // 2. Every shard knows the halves (the old range's shard owns them)
        //    before any instance routes by them.
        super::map::insert_states(
            &self.shards,
            self.group,
            &[(left.id, old.shard), (right.id, old.shard)],
            None,
        )
        .await?;
        // 3. The map: the old range is held for good (a move holding it
        //    refuses the split; no move can take it later), the epoch moves
        //    on only from the one this split was planned on, and the halves
        //    replace it.
        let err = |e| db_err(name, MAP, "split", e);
        let txn = crate::exec::begin_write(db).await.map_err(err)?;
        let claim = Query::insert()
            .into_table(Alias::new(CLAIMS))
            .columns(["grp", "bucket", "move_id"].map(Alias::new))
            .values_panic([self.group.into(), (old.id as i32).into(), 0i64.into()])
            .to_owned();
        if let Err(e) = txn.execute(&claim).await {
            return Err(if crate::error::is_unique_violation(&e) {
                self.refuse(
                    None,
                    format!(
                        "{old} was taken by a move or a split meanwhile: look at the ranges again"
                    ),
                )
            } else {
                db_err(name, CLAIMS, "split", e)
            });
        }
        let bump = Query::update()
            .table(Alias::new(EPOCHS))
            .value(Alias::new("epoch"), Expr::col(Alias::new("epoch")).add(1))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(Expr::col(Alias::new("epoch")).eq(epoch as i64))
            .to_owned();
        if txn.execute(&bump).await.map_err(err)?.rows_affected() != 1 {
            return Err(self.refuse(
                None,
                format!("the map changed while splitting (it was at epoch {epoch}): split again"),
            ));
        }
        let delete = Query::delete()
            .from_table(Alias::new(MAP))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(Expr::col(Alias::new("bucket")).eq(old.id as i32))
            .and_where(Expr::col(Alias::new("shard")).eq(self.shards.shard_name(old.shard)))
            .to_owned();
        if txn.execute(&delete).await.map_err(err)?.rows_affected() != 1 {
            return Err(self.refuse(
                None,
                format!("{old} is not in the map as read any more: split again"),
            ));
        }
        super::map::insert_ranges(
            &self.shards,
            &txn,
            name,
            self.group,
            &[left.clone(), right.clone()],
        )
        .await?;
        txn.commit().await.map_err(err)?;
        tracing::info!(group = self.group, retired = %old, left = %left, right = %right, "range split");
        // The split holds from here on: what follows can fail without
        // undoing it (the next move start finishes it).
        // A process that dies here leaves the old range unfenced on its
        // shard: the next move start fences it.
        self.failpoint("split", 0, old.shard)?;
        // 4. The old range is fenced on its shard: an instance that still
        //    routes by it is refused and reads the new map.
        let fenced = match self.fence_retired(&[old.id], &[old.shard]).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(group = self.group, range = %old, error = %e.report(), "split range not fenced yet; the next move start fences it");
                false
            }
        };
        let epoch = match super::refresh(&self.shards, self.group).await {
            Ok(epoch) => epoch,
            Err(e) => {
                tracing::warn!(group = self.group, error = %e.report(), "map not read after the split");
                epoch + 1
            }
        };
        Ok(RangeSplit {
            retired: old,
            left,
            right,
            epoch,
            fenced,
        })
    }

    /// Refuses a split point of another kind than the group's bounds or
    /// its key type: a map with mixed kinds routes no key.
    fn check_kind(&self, units: &[RangeUnit], at: &RangeBound) -> Result<()> {
        let bound = units.iter().flat_map(|u| [&u.from, &u.to]).flatten().next();
        if let Some(b) = bound
            && !b.same_kind(at)
        {
            let kinds = match b {
                RangeBound::Int(_) => "integers",
                RangeBound::Text(_) => "strings",
            };
            return Err(self.refuse(
                None,
                format!("the split point {at} is not of the kind of the group's bounds ({kinds})"),
            ));
        }
        // The keys' kind, from a listed entity: the group's one range may
        // have no bound yet.
        if let Some(entity) = self.entities.first() {
            let sample = match at {
                RangeBound::Int(v) => entity.bound_at(&v.to_string()),
                RangeBound::Text(t) => entity.bound_at(t),
            };
            if !sample.is_some_and(|s| s.same_kind(at)) {
                return Err(self.refuse(
                    None,
                    format!("the split point {at} is not a shard key of the group's key type"),
                ));
            }
        }
        Ok(())
    }

    fn held(&self, range: &RangeUnit, by: i64) -> ShardError {
        self.refuse(
            None,
            if by > 0 {
                format!("{range} is held by move #{by}, which is not finished: let it finish (or abort it before its cut-over), then split")
            } else {
                format!("{range} was split already: look at the ranges again")
            },
        )
    }

    /// Hands out `n` new range ids of the group (the epoch row counts them).
    async fn allocate_range_ids(&self, n: u32) -> Result<u32> {
        let (db, name) = self.control()?;
        let err = |e| db_err(name, EPOCHS, "allocate", e);
        let txn = crate::exec::begin_write(db).await.map_err(err)?;
        let bump = Query::update()
            .table(Alias::new(EPOCHS))
            .value(
                Alias::new("buckets"),
                Expr::col(Alias::new("buckets")).add(n as i32),
            )
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .to_owned();
        txn.execute(&bump).await.map_err(err)?;
        let (_, next) = super::map::read_epoch(&txn, name, self.group, None)
            .await?
            .ok_or_else(|| {
                self.refuse(None, "the group has no map yet: connect an instance first")
            })?;
        txn.commit().await.map_err(err)?;
        Ok(next - n)
    }

    /// Fences the ranges splits retired that are not fenced yet (a split
    /// whose process stopped before it), on every shard: a move start of a
    /// range group runs it first, so no half moves while an instance can
    /// still write it unlogged by the old range.
    async fn retire_split_ranges(&self) -> Result<()> {
        let (db, name) = self.control()?;
        let stmt = Query::select()
            .column(Alias::new("bucket"))
            .from(Alias::new(CLAIMS))
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(Expr::col(Alias::new("move_id")).eq(0i64))
            .to_owned();
        let retired: Vec<u32> = db
            .query_all(&stmt)
            .await
            .map_err(|e| db_err(name, CLAIMS, "read", e))?
            .iter()
            .filter_map(|r| r.try_get::<i32>("", "bucket").ok())
            .map(|b| b as u32)
            .collect();
        if retired.is_empty() {
            return Ok(());
        }
        let every: Vec<ShardId> = (0..self.shards.topology().shards().len() as u32)
            .map(ShardId)
            .collect();
        self.fence_retired(&retired, &every).await
    }

    /// Sets `retired` ranges `owned` → `moved` on `shards` (waiting for the
    /// writes that hold them), then marks their claims fenced.
    async fn fence_retired(&self, retired: &[u32], shards: &[ShardId]) -> Result<()> {
        let wait = self.shards.rebalance_settings().cutover_wait;
        for &id in shards {
            let conn = self.conn(id);
            let mut attempt = 0;
            loop {
                let fenced = set_states(
                    None,
                    conn,
                    self.group,
                    retired,
                    &[BucketState::Owned],
                    BucketState::Moved,
                    None,
                    Some(wait),
                )
                .await;
                match fenced {
                    Ok(_) => break,
                    // Writes held the old range's state longer than the
                    // wait: try again (they finish).
                    Err(e) if attempt < 20 && e.kind() == crate::ErrorKind::Database => {
                        attempt += 1;
                        tracing::debug!(group = self.group, shard = conn.1, error = %e.report(), "fencing split ranges: again");
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let (db, name) = self.control()?;
        let mark = Query::update()
            .table(Alias::new(CLAIMS))
            .value(Alias::new("move_id"), SPLIT_FENCED)
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .and_where(Expr::col(Alias::new("move_id")).eq(0i64))
            .and_where(Expr::col(Alias::new("bucket")).is_in(retired.iter().map(|b| *b as i32)))
            .to_owned();
        db.execute(&mark)
            .await
            .map(drop)
            .map_err(|e| db_err(name, CLAIMS, "update", e))
    }
}
