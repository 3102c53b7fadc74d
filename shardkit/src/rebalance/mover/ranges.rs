//! Range groups: splitting a range in two on its shard, and planning the
//! move of a range.

use crate::entity::EntityGroup;
use crate::error::{Result, ShardError};
use crate::rebalance::db_err;
use crate::rebalance::map::{BucketState, EPOCHS, MAP, set_states};
use crate::rebalance::mover::{CLAIMS, MovePlan, Rebalance};
use crate::topology::{LiveMap, RangeBound, RangeUnit, ShardId, find_bound};
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};

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
        crate::rebalance::map::refresh(&self.shards, self.group).await?;
        Ok(ranges.units().to_vec())
    }

    /// A shard key given as text (an integer, a string, a UUID) as a range
    /// bound of the group's key type (what `shardctl` passes on).
    pub fn bound_at(&self, key: &str) -> Result<RangeBound> {
        let entity = self
            .entities
            .first()
            .filter(|e| !e.implicit())
            .ok_or_else(|| {
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
        crate::rebalance::map::refresh(&self.shards, self.group).await?;
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
        let (db, name) = self.control_db()?;
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
        crate::rebalance::map::insert_states(
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
        let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
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
        crate::rebalance::map::insert_ranges(
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
        let epoch = match crate::rebalance::map::refresh(&self.shards, self.group).await {
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
        let (db, name) = self.control_db()?;
        let err = |e| db_err(name, EPOCHS, "allocate", e);
        let txn = crate::exec::begin_pooled(db).await.map_err(err)?;
        let bump = Query::update()
            .table(Alias::new(EPOCHS))
            .value(
                Alias::new("buckets"),
                Expr::col(Alias::new("buckets")).add(n as i32),
            )
            .and_where(Expr::col(Alias::new("grp")).eq(self.group))
            .to_owned();
        txn.execute(&bump).await.map_err(err)?;
        let (_, next) = crate::rebalance::map::read_epoch(&txn, name, self.group, None)
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
    pub(super) async fn retire_split_ranges(&self) -> Result<()> {
        let (db, name) = self.control_db()?;
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
        let (db, name) = self.control_db()?;
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
