//! Planning, running, resuming and aborting bucket moves.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::rebalance::entity::{Buckets, MoveEntity, Mover};
use crate::rebalance::fencing::Token;
use crate::rebalance::map::refresh;
use crate::rebalance::map::{BucketState, control, set_states};
use crate::rebalance::{db_err, map};
use crate::topology::MapSnapshot;
use crate::topology::{LiveMap, RangeUnit, ShardId};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, DbErr, IntoActiveModel, Statement};
use std::sync::Arc;
use std::time::Duration;

mod catchup;
mod cutover;
mod hold;
mod ranges;

pub use ranges::RangeSplit;

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

/// Adds `E`'s part in moves after the entities listed before, once.
fn carry<E>(entities: &mut Vec<Arc<dyn MoveEntity>>)
where
    E: ShardedEntity,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    if !entities.iter().any(|e| e.table() == table_name::<E>()) {
        entities.push(Arc::new(Mover::<E>::new()));
    }
}

/// The group of a [`Rebalance`] whose group is known by name only
/// ([`Rebalance::into_any`]): code that handles the entities of several
/// groups as objects (an operator's command line, an admin tool) holds
/// their moves in one type.
#[derive(Debug)]
pub enum AnyGroup {}

impl Rebalance<AnyGroup> {
    /// Adds entity `E` to what moves carry, like [`Rebalance::entity`] on
    /// the typed moves (after the entities added before, once). Refused
    /// with [`ShardError::Rebalance`] when `E` belongs to another group
    /// than these moves.
    pub fn try_entity<E>(mut self) -> Result<Self>
    where
        E: ShardedEntity,
        E::Model: IntoActiveModel<E::ActiveModel> + Sync,
        E::ActiveModel: Send,
    {
        let group = <E::Group as EntityGroup>::NAME;
        if group != self.group {
            return Err(self.refuse(
                None,
                format!(
                    "`{}` belongs to group {group}, not to the group moved",
                    table_name::<E>()
                ),
            ));
        }
        carry::<E>(&mut self.entities);
        Ok(self)
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
        carry::<E>(&mut self.entities);
        self
    }

    /// The same moves, entities and settings with the group's type
    /// forgotten: a [`Rebalance<AnyGroup>`](AnyGroup) of group `G`, for code
    /// that holds the moves of several groups in one type. Add entities to
    /// it with [`try_entity`](Rebalance::try_entity).
    pub fn into_any(self) -> Rebalance<AnyGroup> {
        Rebalance {
            group: self.group,
            shards: self.shards,
            entities: self.entities,
            progress: self.progress,
            wait_for_grace: self.wait_for_grace,
            stop: self.stop,
            token: self.token,
            _group: std::marker::PhantomData,
        }
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
    /// hold lapses 10 s after its last renewal if the process dies; it renews
    /// it every 3 s while it runs). A mover that goes on after another process
    /// took the move over (it was paused past its hold) is refused by every
    /// shard it writes, nothing written: the fencing tokens of
    /// [`crate::rebalance`].
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
