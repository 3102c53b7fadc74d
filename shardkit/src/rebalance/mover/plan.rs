//! What a move is: its plan, phases, status and progress, and the
//! [`Rebalance`] handle that runs moves of a group.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::job::JobControl;
use crate::rebalance::entity::{MoveEntity, Mover};
use crate::rebalance::keyed_rows::KeyedRows;
use crate::reference::References;
use crate::topology::{LiveMap, MapSnapshot, ShardId};
use std::sync::Arc;
use std::time::Duration;

pub(super) const MOVES: &str = "shardkit_moves";
pub(super) const CLAIMS: &str = "shardkit_move_buckets";

/// How long a mover's hold on a move lasts after it last renewed it: another
/// process may take a move over (resume or abort it) once its runner has
/// been silent this long (a mover that died or is paused). A running mover
/// renews its hold every third of this; a mover paused past it is refused
/// by the fencing tokens when it goes on.
pub(crate) const LEASE_MS: i64 = 10_000;

/// Log entries one catch-up round replays at most per source, while
/// writers go on (a replay until the log is empty would never end under a
/// steady write load on the moving buckets).
pub(super) const CATCH_UP: u64 = 10_000;

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
    pub(super) const ALL: [MovePhase; 8] = [
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

    pub(super) fn parse(text: &str) -> Option<Self> {
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

/// What a running move reports to the progress callback of its
/// [`JobControl`] ([`Rebalance::control`]).
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

/// Bucket moves of group `G` ([`Cluster::rebalance`](crate::Cluster::rebalance)).
///
/// List every entity of the group with [`entity`](Self::entity), each
/// after the entities its foreign keys point at (customers before their
/// orders): a move copies, replays and deletes the rows of the entities it
/// knows, writing parents first and deleting children first, and is
/// refused without any.
pub struct Rebalance<G> {
    pub(super) group: &'static str,
    pub(super) shards: Shards,
    pub(super) entities: Vec<Arc<dyn MoveEntity>>,
    pub(super) control: JobControl<MoveProgress>,
    pub(super) wait_for_grace: bool,
    /// This mover's name in `shardkit_moves.runner` while it holds a move.
    pub(super) token: String,
    /// The instance's reference tables, brought to the target before the
    /// cut-over.
    pub(super) references: References,
    _group: std::marker::PhantomData<fn() -> G>,
}

/// A clone carries the same entities and settings (its
/// [`JobControl`] too: the same callback and token) under a new mover name,
/// so two clones running one move fence each other like two processes.
impl<G> Clone for Rebalance<G> {
    fn clone(&self) -> Self {
        Rebalance {
            group: self.group,
            shards: self.shards.clone(),
            entities: self.entities.clone(),
            control: self.control.clone(),
            wait_for_grace: self.wait_for_grace,
            token: crate::uuid_v7().to_string(),
            references: self.references.clone(),
            _group: std::marker::PhantomData,
        }
    }
}

impl<G> std::fmt::Debug for Rebalance<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rebalance")
            .field("group", &self.group)
            .field(
                "entities",
                &self
                    .entities
                    .iter()
                    .map(|e| e.table().to_string())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

pub(super) fn refused(
    id: Option<i64>,
    reason: impl Into<String>,
) -> impl FnOnce(&str) -> ShardError {
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
{
    let table = crate::rebalance::entity::MovingTable::of::<E>();
    if !entities.iter().any(|e| *e.table() == table) {
        // Before shardkit's own tables, which come last.
        let at = entities
            .iter()
            .position(|e| e.implicit())
            .unwrap_or(entities.len());
        entities.insert(at, Arc::new(Mover::<E>::new()));
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
    /// Moves of `G`, refused with [`ShardError::Rebalance`] when `G` is
    /// not a `movable` hash or range group.
    pub(crate) fn new(shards: Shards, references: References) -> Result<Self> {
        let entities = crate::exec::keyed_tables::ALL
            .iter()
            .map(|t| {
                Arc::new(KeyedRows::<G::Key>::new(G::NAME, t, shards.clock().clone()))
                    as Arc<dyn MoveEntity>
            })
            .collect();
        let moves = Rebalance {
            group: G::NAME,
            token: crate::uuid_v7().to_string(),
            shards,
            entities,
            control: JobControl::new(),
            wait_for_grace: false,
            references,
            _group: std::marker::PhantomData,
        };
        moves.map()?;
        Ok(moves)
    }

    /// Adds an entity of the group to what moves carry.
    pub fn entity<E>(mut self) -> Self
    where
        E: ShardedEntity<Group = G>,
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
            control: self.control,
            wait_for_grace: self.wait_for_grace,
            token: self.token,
            references: self.references,
            _group: std::marker::PhantomData,
        }
    }
}

impl<G> Rebalance<G> {
    /// A plan that moves `buckets` to shard `to`, each from its owner in
    /// the current map (read from the database first).
    pub async fn plan_buckets(
        &self,
        buckets: impl IntoIterator<Item = u32>,
        to: &str,
    ) -> Result<MovePlan> {
        let map = self.map()?;
        crate::rebalance::map::refresh(&self.shards, self.group).await?;
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
        crate::rebalance::map::refresh(&self.shards, self.group).await?;
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
}
