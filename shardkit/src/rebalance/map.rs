//! The live bucket map (on each group's control database) and each shard's
//! bucket states: the fence a write transaction checks, and the change log
//! it writes while its bucket moves away.

use crate::error::{Result, ShardError};
use crate::exec::Shards;
use crate::rebalance::db_err;
use crate::rebalance::fencing::{Token, begin_fenced, lock_wait, reset_lock_wait};
use crate::topology::{BucketOwners, LiveMap, RangeBound, RangeOwners, RangeUnit, ShardId};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, OnConflict, Query};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement,
};
use std::time::Duration;

pub(crate) const EPOCHS: &str = "shardkit_bucket_epochs";
pub(crate) const MAP: &str = "shardkit_bucket_map";
pub(crate) const STATES: &str = "shardkit_bucket_states";
pub(crate) const CHANGES: &str = "shardkit_move_changes";

/// A shard's say over one bucket (`shardkit_bucket_states.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BucketState {
    /// The shard owns the bucket: writes go on.
    Owned,
    /// The bucket is moving away: writes go on and log their key.
    Moving,
    /// Fenced: the bucket is being cut over or has moved away.
    Moved,
    /// The shard does not own the bucket.
    None,
}

impl BucketState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BucketState::Owned => "owned",
            BucketState::Moving => "moving",
            BucketState::Moved => "moved",
            BucketState::None => "none",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "owned" => BucketState::Owned,
            "moving" => BucketState::Moving,
            "moved" => BucketState::Moved,
            "none" => BucketState::None,
            _ => return None,
        })
    }
}

/// The group's control database: its first configured shard.
pub(crate) fn control(shards: &Shards, group: &str) -> Result<ShardId> {
    Ok(shards.topology().shards_of(group)?[0])
}

/// The group's live map (buckets or ranges); refused for placements that
/// cannot move.
pub(crate) fn live_map<'a>(shards: &'a Shards, group: &str) -> Result<LiveMap<'a>> {
    shards.topology().live_owners(group)?.ok_or_else(|| {
        ShardError::config(
            format!("groups.{group}.movable"),
            "only hash and range placements can move",
        )
    })
}

/// A background task's claim on one of `group`'s map flags (a map read
/// under way, the grace being recorded): `release` runs on the live map
/// when the claim is dropped armed (see [`crate::exec::periodic::Claim`]).
pub(crate) fn map_claim(
    shards: &Shards,
    group: &str,
    release: fn(&crate::topology::MapReads),
) -> crate::exec::periodic::Claim {
    use crate::exec::periodic::Handle as _;
    let (weak, group) = (shards.downgrade(), group.to_owned());
    crate::exec::periodic::Claim::new(move || {
        // A cluster already gone has no flag to release.
        if let Some(shards) = Shards::upgrade(&weak)
            && let Ok(map) = live_map(&shards, &group)
        {
            release(map.reads());
        }
    })
}

/// Reads the group's map epoch and, when it is newer than the one routing
/// uses, the map; seeds the map from the config when the database has none.
/// Returns the epoch now in use.
pub(crate) async fn refresh(shards: &Shards, group: &str) -> Result<u64> {
    let read = read_map(shards, group, Seed::IfMissing).await?;
    Ok(install_map(shards, group, read).await?.epoch)
}

/// What [`install_map`] did.
pub(crate) struct Installed {
    /// The epoch now in use.
    pub(crate) epoch: u64,
    /// Whether the map counts as read (see [`install_map`]).
    pub(crate) read: bool,
}

/// What [`read_map`] read on the control database.
pub(crate) struct MapRead {
    epoch: u64,
    /// The map's rows, when its epoch is newer than the one routing uses.
    rows: Option<Vec<sea_orm::QueryResult>>,
    /// The control database has no map of the group (read with
    /// [`Seed::Never`]).
    pub(crate) missing: bool,
    /// When the read began (clock ms): what the map is known good as of
    /// once installed.
    started_ms: i64,
    /// The epoch this instance held when the read began.
    held: u64,
}

/// Whether [`read_map`] seeds a map the control database does not have.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seed {
    /// Seed the map and every shard's states (not to be cut off midway:
    /// the states are written in chunks).
    IfMissing,
    /// Leave it to a refresh that may seed: nothing is read (a bounded
    /// read's refresh, which its timeout may cut off).
    Never,
}

/// The control database's part of [`refresh`]: the epoch, the rows of a
/// newer map (seeding the map and the states when there is none and
/// `seed` says so). The only statements a refresh sends there, so a
/// caller can bound them (with [`Seed::Never`]).
pub(crate) async fn read_map(shards: &Shards, group: &str, seed: Seed) -> Result<MapRead> {
    let map = live_map(shards, group)?;
    let started_ms = shards.now_ms();
    let held = map.epoch();
    map.reads().mark_tried(started_ms);
    let id = control(shards, group)?;
    let (db, name) = (shards.side_conn(id), shards.shard_name(id));
    let buckets = match map {
        LiveMap::Buckets(owners) => Some(owners.len() as u32),
        LiveMap::Ranges(_) => None,
    };
    let epoch = match read_epoch(db, name, group, buckets).await? {
        Some((epoch, _)) => epoch,
        None if seed == Seed::Never => {
            if map.epoch() > 0 && map.reads().warn_behind(shards.now_ms()) {
                tracing::warn!(
                    group,
                    shard = name,
                    epoch = map.epoch(),
                    "the control database has no bucket map of the group: routing by this \
                     instance's map (a control database restored from an older copy?)"
                );
            }
            return Ok(MapRead {
                epoch: map.epoch(),
                rows: None,
                missing: true,
                started_ms,
                held,
            });
        }
        None => {
            let epoch = seed_map(shards, group, map).await?;
            // Every shard's fence with the map, in the same step: a map
            // without states would refuse every write.
            seed_states(shards, group).await?;
            epoch
        }
    };
    if epoch <= map.epoch() {
        return Ok(MapRead {
            epoch,
            rows: None,
            missing: false,
            started_ms,
            held,
        });
    }
    let mut stmt = Query::select();
    stmt.columns([Alias::new("bucket"), Alias::new("shard")])
        .from(Alias::new(MAP))
        .and_where(Expr::col(Alias::new("grp")).eq(group));
    if buckets.is_none() {
        // Named explicitly: SQLite names an unaliased column after the
        // text the statement was first prepared from, and a pooled
        // connection that prepared it before the migration added the
        // column keeps a quoted name.
        for column in ["lo", "hi"] {
            stmt.expr_as(Expr::col(Alias::new(column)), Alias::new(column));
        }
    }
    let rows = db
        .query_all(&stmt)
        .await
        .map_err(|e| db_err(name, MAP, "read", e))?;
    Ok(MapRead {
        epoch,
        rows: Some(rows),
        missing: false,
        started_ms,
        held,
    })
}

/// The rest of [`refresh`]: installs a newer map read by [`read_map`]
/// (after raising the replicas' floors). The map
/// counts as read at the read's start once installed, or when it was as
/// new; not when the control database holds an older map than this
/// instance, or none while this instance holds one (a copy restored or
/// failed over from before a move: moves since may be missing from it).
pub(crate) async fn install_map(shards: &Shards, group: &str, read: MapRead) -> Result<Installed> {
    let map = live_map(shards, group)?;
    let MapRead {
        epoch,
        rows,
        missing,
        started_ms,
        held,
    } = read;
    if let Some(rows) = rows
        && epoch > map.epoch()
    {
        let name = shards.shard_name(control(shards, group)?);
        // Replicas answer for the new map only once past every copy the
        // moves behind it made (see `Shards::raise_replica_floors`).
        shards.raise_replica_floors().await;
        let installed = match map {
            LiveMap::Buckets(owners) => install_buckets(shards, group, name, owners, epoch, rows)?,
            LiveMap::Ranges(ranges) => install_ranges(shards, group, ranges, epoch, rows)?,
        };
        if installed {
            tracing::info!(group, epoch, "bucket map installed");
            crate::metrics::map_epoch(group, epoch);
        }
    }
    let current = if missing { held == 0 } else { epoch >= held };
    if current {
        // In the background: a write on the control database, which may
        // wait for its locks, is not for a read's time.
        if !missing && map.reads().claim_grace() {
            // Dropped unrecorded, the grace is to be recorded again.
            let claim = map_claim(shards, group, |reads| reads.set_grace_recorded(false));
            let group = group.to_owned();
            crate::exec::periodic::spawn_once(shards, move |shards: Shards| async move {
                record_grace(&shards, &group).await;
                claim.arm(false);
            });
        }
        map.reads().mark_read(started_ms, shards.now_ms());
    } else {
        // A control database restored from an older copy may have lost the
        // recorded grace too: recorded again once it is current.
        map.reads().set_grace_recorded(false);
    }
    if !current && !missing && map.reads().warn_behind(shards.now_ms()) {
        tracing::warn!(
            group,
            control = epoch,
            held,
            "the control database's bucket map is older than this instance's (restored or \
             failed over to an older copy?): routing by this instance's map, which stops \
             counting as read"
        );
    }
    Ok(Installed {
        epoch: map.epoch(),
        read: current,
    })
}

/// A map row's owner.
fn row_owner(
    shards: &Shards,
    group: &str,
    row: &sea_orm::QueryResult,
    name: &str,
) -> Result<(i32, ShardId)> {
    let get = |e| db_err(name, MAP, "read", e);
    let bucket: i32 = row.try_get("", "bucket").map_err(get)?;
    let shard: String = row.try_get("", "shard").map_err(get)?;
    let owner = shards.topology().shard_id(&shard).ok_or_else(|| {
        ShardError::config(
            format!("{MAP}[{group}, bucket {bucket}]"),
            format!(
                "the bucket map names shard `{shard}`, which `[[shards]]` does not define: every instance needs every shard a move added"
            ),
        )
    })?;
    Ok((bucket, owner))
}

fn install_buckets(
    shards: &Shards,
    group: &str,
    name: &str,
    owners: &BucketOwners,
    epoch: u64,
    rows: Vec<sea_orm::QueryResult>,
) -> Result<bool> {
    let buckets = owners.len();
    let mut map = owners.to_vec();
    let mut seen = 0usize;
    for row in rows {
        let (bucket, owner) = row_owner(shards, group, &row, name)?;
        if let Some(slot) = usize::try_from(bucket).ok().and_then(|b| map.get_mut(b)) {
            *slot = owner;
            seen += 1;
        }
    }
    if seen != buckets {
        return Err(ShardError::config(
            format!("{MAP}[{group}]"),
            format!("the bucket map holds {seen} of the group's {buckets} buckets"),
        ));
    }
    Ok(owners.install(epoch, &map))
}

fn install_ranges(
    shards: &Shards,
    group: &str,
    ranges: &RangeOwners,
    epoch: u64,
    rows: Vec<sea_orm::QueryResult>,
) -> Result<bool> {
    let name = shards.shard_name(control(shards, group)?);
    let mut units = Vec::with_capacity(rows.len());
    for row in rows {
        let (id, shard) = row_owner(shards, group, &row, name)?;
        let bound = |column: &str| -> Result<Option<RangeBound>> {
            let text: Option<String> = row
                .try_get("", column)
                .map_err(|e| db_err(name, MAP, "read", e))?;
            text.map(|t| {
                RangeBound::decode(&t).ok_or_else(|| {
                    ShardError::config(
                        format!("{MAP}[{group}, bucket {id}].{column}"),
                        format!("{t:?} is not a range bound (`i:<integer>` or `t:<text>`)"),
                    )
                })
            })
            .transpose()
        };
        units.push(RangeUnit {
            id: id as u32,
            from: bound("lo")?,
            to: bound("hi")?,
            shard,
        });
    }
    // Unbounded-below sorts first (None < Some).
    units.sort_by(|a, b| a.from.cmp(&b.from));
    let bounds: Vec<&RangeBound> = units
        .iter()
        .flat_map(|u| [&u.from, &u.to])
        .flatten()
        .collect();
    let one_kind = bounds.windows(2).all(|w| w[0].same_kind(w[1]));
    let contiguous = !units.is_empty()
        && units
            .windows(2)
            .all(|w| w[0].to.is_some() && w[0].to == w[1].from)
        && units.iter().all(|u| match (&u.from, &u.to) {
            (Some(from), Some(to)) => from < to,
            _ => true,
        });
    if !one_kind || !contiguous {
        return Err(ShardError::config(
            format!("{MAP}[{group}]"),
            format!(
                "the group's ranges in the bucket map are not contiguous ranges with bounds of one kind: {}",
                units
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    Ok(ranges.install(epoch, units))
}

/// Records this process's `cleanup_grace_ms` as `group`'s on the control
/// database when it is longer than the one recorded there (see
/// [`recorded_grace`]); claimed once per process and group (when its map
/// first counts as read) while the control database keeps it. Best effort:
/// a control database not migrated to hold it, or one that fails or does
/// not answer, is tried again after the next map read (logged).
async fn record_grace(shards: &Shards, group: &str) {
    let Ok(map) = live_map(shards, group) else {
        return;
    };
    let Ok(id) = control(shards, group) else {
        map.reads().set_grace_recorded(false);
        return;
    };
    let name = shards.shard_name(id);
    let grace = shards.rebalance_settings().cleanup_grace;
    let ms = grace.as_millis() as i64;
    let stmt = Query::update()
        .table(Alias::new(EPOCHS))
        .value(Alias::new("grace_ms"), ms)
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .and_where(
            Expr::col(Alias::new("grace_ms"))
                .is_null()
                .or(Expr::col(Alias::new("grace_ms")).lt(ms)),
        )
        .to_owned();
    // Bounded like a map read: a control database that stops answering
    // holds no refresh.
    let within = shards
        .read_settings()
        .control_bound()
        .max(Duration::from_secs(5));
    let recorded = async {
        match shards.side_conn(id).execute(&stmt).await {
            Ok(_) => recorded_grace(shards, group).await,
            Err(e) if grace_not_migrated(&e) => {
                let e = db_err(name, EPOCHS, "record the cleanup grace in", e);
                tracing::debug!(group, error = %e.report(), "cleanup grace not recorded (run migrate)");
                Ok(None)
            }
            Err(e) => Err(db_err(name, EPOCHS, "record the cleanup grace in", e)),
        }
    };
    let outcome = tokio::time::timeout(within, recorded).await;
    map.reads()
        .set_grace_recorded(matches!(outcome, Ok(Ok(Some(kept))) if kept >= grace));
    match outcome {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(group, error = %e.report(), "cleanup grace not recorded on the control database")
        }
        Err(_) => tracing::warn!(
            group,
            shard = name,
            ?within,
            "cleanup grace not recorded: the control database did not answer"
        ),
    }
}

/// The longest `cleanup_grace_ms` a process has recorded for `group` on the
/// control database (`None`: none, or a control database not migrated to
/// hold it): a mover cleans after it, so that an instance whose grace is
/// longer than the mover's does not route reads to a cleaned shard.
pub(crate) async fn recorded_grace(shards: &Shards, group: &str) -> Result<Option<Duration>> {
    let id = control(shards, group)?;
    let name = shards.shard_name(id);
    // Named explicitly: SQLite takes an unknown quoted name for text, so a
    // pooled connection that prepared the statement before the migration
    // added the column keeps a quoted name (as `read_map`'s bounds).
    let stmt = Query::select()
        .expr_as(Expr::col(Alias::new("grace_ms")), Alias::new("grace_ms"))
        .from(Alias::new(EPOCHS))
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .to_owned();
    let row = match shards.side_conn(id).query_one(&stmt).await {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(None),
        Err(e) if grace_not_migrated(&e) => return Ok(None),
        Err(e) => return Err(db_err(name, EPOCHS, "read", e)),
    };
    // Text (SQLite's reading of a column not there yet): none recorded.
    let ms: Option<i64> = row.try_get("", "grace_ms").unwrap_or(None);
    Ok(ms
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis))
}

/// Whether the driver said the recorded grace's column or table is not
/// there (a control database not migrated yet); no other error is taken
/// for that.
fn grace_not_migrated(e: &sea_orm::DbErr) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    (text.contains("grace_ms") || text.contains(EPOCHS))
        && [
            "no such column",
            "unknown column",
            "no such table",
            "does not exist",
            "doesn't exist",
        ]
        .iter()
        .any(|said| text.contains(said))
}

/// The group's epoch and its `buckets` column (a range group: the next
/// range id); `buckets`, when given, must be what the map was made with.
pub(crate) async fn read_epoch(
    db: &impl ConnectionTrait,
    name: &str,
    group: &str,
    buckets: Option<u32>,
) -> Result<Option<(u64, u32)>> {
    let stmt = Query::select()
        .columns([Alias::new("epoch"), Alias::new("buckets")])
        .from(Alias::new(EPOCHS))
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .to_owned();
    let Some(row) = db
        .query_one(&stmt)
        .await
        .map_err(|e| db_err(name, EPOCHS, "read", e))?
    else {
        return Ok(None);
    };
    let get = |e| db_err(name, EPOCHS, "read", e);
    let epoch: i64 = row.try_get("", "epoch").map_err(get)?;
    let stored: i32 = row.try_get("", "buckets").map_err(get)?;
    if let Some(buckets) = buckets
        && stored as i64 != i64::from(buckets)
    {
        return Err(ShardError::config(
            format!("groups.{group}.buckets"),
            format!(
                "the config says {buckets} buckets but the group's bucket map (on shard `{name}`) has {stored}: the number of buckets is fixed for the life of the data"
            ),
        ));
    }
    Ok(Some((epoch as u64, stored as u32)))
}

/// Writes the configured spread as epoch 1 (unless another instance got
/// there first) and returns the stored epoch.
async fn seed_map(shards: &Shards, group: &str, map: LiveMap<'_>) -> Result<u64> {
    // A range group's `buckets` counts the range ids handed out.
    let (buckets, expected) = match map {
        LiveMap::Buckets(owners) => (owners.len() as u32, Some(owners.len() as u32)),
        LiveMap::Ranges(ranges) => (ranges.configured().len() as u32, None),
    };
    let id = control(shards, group)?;
    let (db, name) = (shards.side_conn(id), shards.shard_name(id));
    let txn = crate::exec::begin_pooled(db)
        .await
        .map_err(|e| db_err(name, EPOCHS, "seed", e))?;
    let insert = Query::insert()
        .into_table(Alias::new(EPOCHS))
        .columns([
            Alias::new("grp"),
            Alias::new("epoch"),
            Alias::new("buckets"),
        ])
        .values_panic([group.into(), 1i64.into(), (buckets as i32).into()])
        .to_owned();
    match txn.execute(&insert).await {
        Ok(_) => {}
        Err(e) if crate::error::is_unique_violation(&e) => {
            drop(txn);
            return read_epoch(db, name, group, expected)
                .await?
                .map(|(epoch, _)| epoch)
                .ok_or_else(|| db_err(name, EPOCHS, "seed", e));
        }
        Err(e) => return Err(db_err(name, EPOCHS, "seed", e)),
    }
    match map {
        LiveMap::Buckets(owners) => {
            let configured = owners.configured();
            for chunk in (0..buckets).collect::<Vec<_>>().chunks(500) {
                let mut insert = Query::insert();
                insert.into_table(Alias::new(MAP)).columns([
                    Alias::new("grp"),
                    Alias::new("bucket"),
                    Alias::new("shard"),
                ]);
                for &b in chunk {
                    insert.values_panic([
                        group.into(),
                        (b as i32).into(),
                        shards.shard_name(configured[b as usize]).into(),
                    ]);
                }
                txn.execute(&insert)
                    .await
                    .map_err(|e| db_err(name, MAP, "seed", e))?;
            }
        }
        LiveMap::Ranges(ranges) => {
            insert_ranges(shards, &txn, name, group, ranges.configured()).await?;
        }
    }
    txn.commit()
        .await
        .map_err(|e| db_err(name, MAP, "seed", e))?;
    tracing::info!(group, shard = name, "bucket map seeded from the config");
    Ok(1)
}

/// Gives every shard of the cluster a state row for each of the group's
/// buckets it lacks: `owned` where the map in use says it owns the bucket,
/// `none` elsewhere.
/// Inserts map rows for `units` (a range group's ranges) in `txn`.
pub(crate) async fn insert_ranges(
    shards: &Shards,
    txn: &DatabaseTransaction,
    name: &str,
    group: &str,
    units: &[RangeUnit],
) -> Result<()> {
    for chunk in units.chunks(200) {
        let mut insert = Query::insert();
        insert.into_table(Alias::new(MAP)).columns([
            Alias::new("grp"),
            Alias::new("bucket"),
            Alias::new("shard"),
            Alias::new("lo"),
            Alias::new("hi"),
        ]);
        for u in chunk {
            insert.values_panic([
                group.into(),
                (u.id as i32).into(),
                shards.shard_name(u.shard).into(),
                u.from.as_ref().map(RangeBound::encode).into(),
                u.to.as_ref().map(RangeBound::encode).into(),
            ]);
        }
        txn.execute(&insert)
            .await
            .map_err(|e| db_err(name, MAP, "write", e))?;
    }
    Ok(())
}

pub(crate) async fn seed_states(shards: &Shards, group: &str) -> Result<()> {
    let map = live_map(shards, group)?;
    let units = map.snapshot().units();
    // A hash group's shard with a row per bucket has them all; a range
    // group's ranges are few and change with splits: always checked.
    let complete = match map {
        LiveMap::Buckets(owners) => Some(owners.len() as i64),
        LiveMap::Ranges(_) => None,
    };
    insert_states(shards, group, &units, complete).await
}

/// After a fence refused a write of `group` on `shard`: reads the map
/// again, and seeds the states when the shard has none of the group (a
/// set-up that stopped between seeding the map and the states, or a shard
/// added to the config since). Returns the epoch in use.
pub(crate) async fn after_refusal(shards: &Shards, group: &str, shard: ShardId) -> Result<u64> {
    let epoch = refresh(shards, group).await?;
    let (db, name) = (shards.side_conn(shard), shards.shard_name(shard));
    if state_rows(db, name, group).await? == 0 {
        tracing::info!(
            group,
            shard = name,
            "the shard has no bucket states: seeding them"
        );
        seed_states(shards, group).await?;
    }
    Ok(epoch)
}

async fn state_rows(db: &DatabaseConnection, name: &str, group: &str) -> Result<i64> {
    let count = Query::select()
        .expr_as(Expr::col(Alias::new("bucket")).count(), Alias::new("n"))
        .from(Alias::new(STATES))
        .and_where(Expr::col(Alias::new("grp")).eq(group))
        .to_owned();
    Ok(db
        .query_one(&count)
        .await
        .map_err(|e| db_err(name, STATES, "read", e))?
        .and_then(|row| row.try_get("", "n").ok())
        .unwrap_or(0))
}

/// Gives every shard a state row for each of `units` it lacks (`owned` on
/// the unit's owner, `none` elsewhere); a shard that has `complete` rows
/// of the group is skipped. A shard that owns none of `units` and cannot
/// take them (not migrated yet: a shard just added to the config; or down)
/// is left out and reported: it gets its rows once migrated, from the next
/// `migrate` or connect, before any move can hand it a bucket.
pub(crate) async fn insert_states(
    shards: &Shards,
    group: &str,
    units: &[(u32, ShardId)],
    complete: Option<i64>,
) -> Result<()> {
    for (index, _) in shards.topology().shards().iter().enumerate() {
        let id = ShardId(index as u32);
        let (db, name) = (shards.side_conn(id), shards.shard_name(id));
        let n = match state_rows(db, name, group).await {
            Ok(n) => n,
            Err(e)
                if e.kind() == crate::ErrorKind::Database
                    && !units.iter().any(|(_, owner)| *owner == id) =>
            {
                if crate::rebalance::errors::missing_table(&e) {
                    tracing::warn!(
                        group,
                        shard = name,
                        "shard is not migrated yet and owns no bucket: run `migrate` before moving buckets to it"
                    );
                } else {
                    tracing::warn!(group, shard = name, error = %e.report(), "shard unreachable and owns no bucket: its bucket states are seeded later");
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if complete.is_some_and(|all| n >= all) {
            continue;
        }
        for chunk in units.chunks(500) {
            let mut insert = Query::insert();
            insert.into_table(Alias::new(STATES)).columns([
                Alias::new("grp"),
                Alias::new("bucket"),
                Alias::new("state"),
            ]);
            let mysql = db.get_database_backend() == DbBackend::MySql;
            if !mysql {
                insert.on_conflict(
                    OnConflict::columns([Alias::new("grp"), Alias::new("bucket")])
                        .do_nothing()
                        .to_owned(),
                );
            }
            for &(b, owner) in chunk {
                let state = if owner == id {
                    BucketState::Owned
                } else {
                    BucketState::None
                };
                insert.values_panic([group.into(), (b as i32).into(), state.as_str().into()]);
            }
            let mut stmt = db.get_database_backend().build(&insert);
            if mysql {
                // MySQL/MariaDB have no `DO NOTHING`.
                stmt.sql = stmt.sql.replacen("INSERT", "INSERT IGNORE", 1);
            }
            db.execute_raw(stmt)
                .await
                .map_err(|e| db_err(name, STATES, "seed", e))?;
        }
    }
    Ok(())
}

/// What the fence said about a write transaction's bucket.
pub(crate) enum Fence {
    /// Write on.
    Open,
    /// Write on; the key was logged for the move.
    Logged,
}

/// The fence: reads the bucket's state on the transaction's shard under a
/// shared row lock (held to the end of the transaction, so a cut-over's
/// update of the state waits for the transaction, and the transaction
/// begun after it sees the new state), refuses a bucket the shard does not
/// own, and logs the key when the bucket is moving away.
pub(crate) async fn fence(
    txn: &DatabaseTransaction,
    shard: &str,
    group: &'static str,
    bucket: u32,
    key_text: &str,
) -> Result<Fence> {
    let backend = txn.get_database_backend();
    let (sql, lock) = match backend {
        DbBackend::Postgres => ("grp = $1 AND bucket = $2", " FOR SHARE"),
        DbBackend::MySql => ("grp = ? AND bucket = ?", " LOCK IN SHARE MODE"),
        _ => ("grp = ? AND bucket = ?", ""),
    };
    let stmt = Statement::from_sql_and_values(
        backend,
        format!("SELECT state, move_id FROM {STATES} WHERE {sql}{lock}"),
        [group.into(), (bucket as i32).into()],
    );
    let err = |e| db_err(shard, STATES, "read", e);
    let row = txn.query_one_raw(stmt).await.map_err(err)?;
    let Some(row) = row else {
        // No row: the shard was added after the map was seeded and no
        // instance has seeded it since; it owns nothing yet.
        return Err(moved(group, bucket, shard, BucketState::None));
    };
    let state: String = row.try_get("", "state").map_err(err)?;
    let move_id: Option<i64> = row.try_get("", "move_id").map_err(err)?;
    match BucketState::parse(&state) {
        Some(BucketState::Owned) => Ok(Fence::Open),
        Some(BucketState::Moving) => {
            let insert = Query::insert()
                .into_table(Alias::new(CHANGES))
                .columns([
                    Alias::new("move_id"),
                    Alias::new("bucket"),
                    Alias::new("key_text"),
                ])
                .values_panic([
                    move_id.unwrap_or_default().into(),
                    (bucket as i32).into(),
                    key_text.into(),
                ])
                .to_owned();
            txn.execute(&insert)
                .await
                .map_err(|e| db_err(shard, CHANGES, "insert", e))?;
            Ok(Fence::Logged)
        }
        Some(s) => Err(moved(group, bucket, shard, s)),
        None => Err(ShardError::config(
            format!("{STATES}[{group}, bucket {bucket}] on shard `{shard}`"),
            format!("unknown bucket state {state:?}"),
        )),
    }
}

fn moved(group: &'static str, bucket: u32, shard: &str, state: BucketState) -> ShardError {
    ShardError::BucketMoved {
        group,
        bucket,
        shard: shard.to_owned(),
        state: state.as_str().to_owned(),
    }
}

/// Sets the state of `buckets` on one shard (only rows whose state is one
/// of `from`), in its own transaction, waiting at most `wait` for the
/// transactions that hold the rows' shared locks. Returns the rows changed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn set_states(
    token: Option<&Token>,
    (db, shard): (&DatabaseConnection, &str),
    group: &str,
    buckets: &[u32],
    from: &[BucketState],
    to: BucketState,
    move_id: Option<i64>,
    wait: Option<Duration>,
) -> Result<u64> {
    let err = |e| db_err(shard, STATES, "update", e);
    let txn = begin_fenced(token, (db, shard), "states", STATES).await?;
    lock_wait(&txn, wait).await.map_err(err)?;
    let updated = update_states(&txn, group, buckets, from, to, move_id).await;
    reset_lock_wait(&txn, wait).await.map_err(err)?;
    let changed = updated.map_err(err)?;
    txn.commit().await.map_err(err)?;
    Ok(changed)
}

async fn update_states(
    txn: &DatabaseTransaction,
    group: &str,
    buckets: &[u32],
    from: &[BucketState],
    to: BucketState,
    move_id: Option<i64>,
) -> std::result::Result<u64, DbErr> {
    let mut changed = 0;
    for chunk in buckets.chunks(500) {
        let stmt = Query::update()
            .table(Alias::new(STATES))
            .value(Alias::new("state"), to.as_str())
            .value(Alias::new("move_id"), move_id)
            .and_where(Expr::col(Alias::new("grp")).eq(group))
            .and_where(Expr::col(Alias::new("bucket")).is_in(chunk.iter().map(|b| *b as i32)))
            .and_where(Expr::col(Alias::new("state")).is_in(from.iter().map(|s| s.as_str())))
            .to_owned();
        changed += txn.execute(&stmt).await?.rows_affected();
    }
    Ok(changed)
}
