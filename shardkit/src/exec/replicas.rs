//! Read replicas of the shards: where a commit landed in a primary's log
//! ([`Position`]), the sessions that carry those positions from a write to
//! later reads ([`Session`]), what a read asks of the database that answers
//! it ([`Consistency`]), and each replica's pool and measured lag
//! ([`Replica`]).

use crate::error::{Bounded, Result, ShardError};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where a commit landed in a shard's log: PostgreSQL's WAL position
/// (`pg_current_wal_flush_lsn()` after the commit), or MySQL/MariaDB's
/// GTID position (`@@gtid_binlog_pos`), one sequence number per
/// replication domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Position {
    /// A WAL position as a number (`16/B374D848` is `0x16_B374D848`).
    Lsn(u64),
    /// Per replication domain: (server id, sequence number).
    Gtid(BTreeMap<u32, (u32, u64)>),
}

impl Position {
    /// A position no replica reaches: reads of its shard go to the shard.
    pub(crate) fn unreachable(backend: DbBackend) -> Position {
        match backend {
            DbBackend::Postgres => Position::Lsn(u64::MAX),
            _ => Position::Gtid(BTreeMap::from([(u32::MAX, (u32::MAX, u64::MAX))])),
        }
    }

    /// Whether it is a position of a `backend` server's log (a session's
    /// text is the caller's input: a GTID position for a PostgreSQL shard
    /// is not).
    pub(crate) fn fits(&self, backend: DbBackend) -> bool {
        matches!(
            (self, backend),
            (Position::Lsn(_), DbBackend::Postgres) | (Position::Gtid(_), DbBackend::MySql)
        )
    }

    /// Whether no replica can reach it (see [`Position::unreachable`]).
    pub(crate) fn is_unreachable(&self) -> bool {
        match self {
            Position::Lsn(lsn) => *lsn == u64::MAX,
            Position::Gtid(map) => map.get(&u32::MAX).is_some_and(|(_, n)| *n == u64::MAX),
        }
    }

    /// The later of two positions of one shard, per GTID domain.
    pub(crate) fn merge(&mut self, other: Position) {
        match (self, other) {
            (Position::Lsn(a), Position::Lsn(b)) => *a = (*a).max(b),
            (Position::Gtid(a), Position::Gtid(b)) => {
                for (domain, (server, seq)) in b {
                    let entry = a.entry(domain).or_insert((server, seq));
                    if seq > entry.1 {
                        *entry = (server, seq);
                    }
                }
            }
            (this, other) => *this = other,
        }
    }

    /// A PostgreSQL LSN as `pg_lsn` prints it.
    fn parse_lsn(text: &str) -> Option<u64> {
        let (hi, lo) = text.split_once('/')?;
        let half = |h: &str| {
            (!h.is_empty() && h.len() <= 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| u64::from_str_radix(h, 16).ok())
                .flatten()
        };
        Some((half(hi)? << 32) | half(lo)?)
    }

    /// A GTID position as MariaDB prints it (`0-1-42,1-2-7`; empty: none).
    fn parse_gtid(text: &str) -> Option<BTreeMap<u32, (u32, u64)>> {
        let mut map = BTreeMap::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let mut it = part.splitn(3, '-');
            let domain = it.next()?.parse().ok()?;
            let server = it.next()?.parse().ok()?;
            let seq: u64 = it.next()?.parse().ok()?;
            // A domain given twice: its later position.
            let entry = map.entry(domain).or_insert((server, seq));
            if seq > entry.1 {
                *entry = (server, seq);
            }
        }
        Some(map)
    }

    fn gtid_text(map: &BTreeMap<u32, (u32, u64)>) -> String {
        map.iter()
            .map(|(d, (s, n))| format!("{d}-{s}-{n}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Whether `self` (a replica's replayed position) covers `want`.
    fn covers(&self, want: &Position) -> bool {
        match (self, want) {
            (Position::Lsn(have), Position::Lsn(want)) => have >= want,
            (Position::Gtid(have), Position::Gtid(want)) => want
                .iter()
                .all(|(d, (_, n))| have.get(d).is_some_and(|(_, h)| h >= n)),
            _ => false,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Lsn(lsn) => write!(f, "pg:{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF),
            Position::Gtid(map) => write!(f, "gtid:{}", Position::gtid_text(map)),
        }
    }
}

impl FromStr for Position {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if let Some(lsn) = s.strip_prefix("pg:") {
            Position::parse_lsn(lsn)
                .map(Position::Lsn)
                .ok_or_else(|| format!("{} is not a WAL position", Bounded(lsn)))
        } else if let Some(gtid) = s.strip_prefix("gtid:") {
            Position::parse_gtid(gtid)
                .map(Position::Gtid)
                .ok_or_else(|| format!("{} is not a GTID position", Bounded(gtid)))
        } else {
            Err(format!(
                "{} is neither a WAL position (`pg:...`) nor a GTID position (`gtid:...`)",
                Bounded(s)
            ))
        }
    }
}

/// A primary's position now: where every commit acknowledged before this
/// call has landed. `None` on SQLite (no replicas).
pub(crate) async fn primary_position(
    db: &DatabaseConnection,
) -> std::result::Result<Option<Position>, sea_orm::DbErr> {
    match db.get_database_backend() {
        DbBackend::Postgres => {
            read_position(db, "SELECT pg_current_wal_flush_lsn()::text AS p").await
        }
        DbBackend::MySql => read_position(db, "SELECT @@gtid_binlog_pos AS p").await,
        _ => Ok(None),
    }
}

/// The position statement `sql` reads (as column `p`): a WAL position on
/// PostgreSQL, a GTID position on MySQL/MariaDB.
async fn read_position(
    db: &DatabaseConnection,
    sql: &str,
) -> std::result::Result<Option<Position>, sea_orm::DbErr> {
    let backend = db.get_database_backend();
    let row = db
        .query_one_raw(Statement::from_string(backend, sql))
        .await?;
    let text: Option<String> = match row {
        Some(row) => row.try_get("", "p")?,
        None => None,
    };
    let Some(text) = text.filter(|t| !t.is_empty()) else {
        // No position (replay not started, no binary log): unknown.
        return Ok(None);
    };
    Ok(match backend {
        DbBackend::Postgres => Position::parse_lsn(&text).map(Position::Lsn),
        _ => Position::parse_gtid(&text).map(Position::Gtid),
    })
}

/// Read-your-writes across requests and processes: the positions of the
/// commits a user made, per shard, and the newest bucket map each `movable`
/// group's commits were routed by. Record a transaction's commit with
/// [`ShardTx::commit_in`](crate::tx::ShardTx::commit_in); read with
/// [`Consistency::AtLeast`] and a replica answers only once it has replayed
/// past every commit recorded for its shard (else the shard itself does),
/// and an instance whose bucket map is older than the session's reads the
/// map again before it routes the read (a key whose bucket moved is read
/// on its new owner, not on the old one, whose rows stay as they were at
/// the move until they are cleaned).
///
/// Cheap to clone (clones share the positions). Its text
/// ([`Display`](fmt::Display), [`FromStr`]) is short
/// (`s0=pg:16/B374D848;s2=gtid:0-1-42;Customer=map:7`), holds no key or row
/// value, and can travel in a cookie or a header from one request, or one
/// process, to the next.
#[derive(Clone, Default)]
pub struct Session {
    seen: Arc<Mutex<Seen>>,
}

/// What a session has seen: positions per shard, map epochs per group.
#[derive(Clone, Default)]
struct Seen {
    positions: BTreeMap<String, Position>,
    epochs: BTreeMap<String, u64>,
    /// Per shard whose position is [`Position::unreachable`], the count of
    /// [`Seen::marks`] when it became so: a position read after that (a
    /// later commit's) covers the commits it stood for, and replaces it.
    unreachable_since: BTreeMap<String, u64>,
    /// Unreachable positions recorded so far.
    marks: u64,
    /// Per shard whose position is unreachable, the later of the
    /// positions recorded while it was (another request's, merged in): a
    /// position that replaces the unreachable one takes them in, since
    /// they may be of commits that ended after it was read.
    held: BTreeMap<String, Position>,
}

impl Session {
    /// A session with no writes yet.
    pub fn new() -> Self {
        Session::default()
    }

    /// Whether no commit is recorded.
    pub fn is_empty(&self) -> bool {
        let seen = self.lock();
        seen.positions.is_empty() && seen.epochs.is_empty()
    }

    /// Records that a commit on `shard` landed at `position`.
    pub(crate) fn record(&self, shard: &str, position: Position) {
        self.lock().record(shard, position);
    }

    /// What to pass to [`record_read_after`](Self::record_read_after) for
    /// a position read from now on.
    pub(crate) fn mark(&self) -> u64 {
        self.lock().marks
    }

    /// Records a commit's `position` on `shard`, read after [`mark`]
    /// returned `since`: it replaces an unreachable position recorded
    /// before that (the commits it stood for had ended, so this position is
    /// past them), which would otherwise send the session's reads of the
    /// shard to the shard itself for good.
    ///
    /// [`mark`]: Self::mark
    pub(crate) fn record_read_after(&self, shard: &str, position: Position, since: u64) {
        let mut seen = self.lock();
        if !position.is_unreachable()
            && seen
                .unreachable_since
                .get(shard)
                .is_some_and(|&at| at <= since)
        {
            seen.unreachable_since.remove(shard);
            let mut position = position;
            if let Some(held) = seen.held.remove(shard) {
                position.merge(held);
            }
            seen.positions.insert(shard.to_owned(), position);
        } else {
            seen.record(shard, position);
        }
    }

    /// Records that a commit of `group` was routed by its bucket map of
    /// `epoch`.
    pub(crate) fn record_epoch(&self, group: &str, epoch: u64) {
        self.lock().record_epoch(group, epoch);
    }

    /// The position a replica of `shard` must have replayed.
    pub(crate) fn position(&self, shard: &str) -> Option<Position> {
        self.lock().positions.get(shard).cloned()
    }

    /// The newest bucket map epoch of `group` a commit recorded here was
    /// routed by.
    pub(crate) fn epoch(&self, group: &str) -> Option<u64> {
        self.lock().epochs.get(group).copied()
    }

    /// Takes in every position and map epoch of `other` (another
    /// request's session).
    pub fn merge(&self, other: &Session) {
        if Arc::ptr_eq(&self.seen, &other.seen) {
            return;
        }
        let theirs = other.lock().clone();
        let mut seen = self.lock();
        for (shard, position) in theirs.positions {
            seen.record(&shard, position);
        }
        for (group, epoch) in theirs.epochs {
            seen.record_epoch(&group, epoch);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A [`ShardTx::commit_in`](crate::ShardTx::commit_in) under way: if it
/// stops before it has recorded its commit in the session (its future
/// dropped, say by a request's timeout, or a panic), whether the commit
/// landed is unknown, and the session records it as such: the bucket map
/// it routed by, and the shard's reads sent to the shard itself (as after
/// a commit whose outcome is unknown).
pub(crate) struct PendingCommit<'a> {
    pub(crate) session: &'a Session,
    pub(crate) shard: &'a str,
    pub(crate) backend: DbBackend,
    /// The group and its bucket map's epoch, for a `movable` group.
    pub(crate) epoch: Option<(&'static str, u64)>,
}

impl PendingCommit<'_> {
    /// The commit is recorded (or surely did not happen).
    pub(crate) fn finished(self) {
        std::mem::forget(self);
    }
}

impl Drop for PendingCommit<'_> {
    fn drop(&mut self) {
        if let Some((group, epoch)) = self.epoch {
            self.session.record_epoch(group, epoch);
        }
        if self.backend != DbBackend::Sqlite {
            self.session
                .record(self.shard, Position::unreachable(self.backend));
        }
    }
}

impl Seen {
    fn record(&mut self, shard: &str, position: Position) {
        if position.is_unreachable() {
            self.marks += 1;
            self.unreachable_since.insert(shard.to_owned(), self.marks);
        }
        match self.positions.get_mut(shard) {
            Some(known) => {
                if known.is_unreachable() && !position.is_unreachable() {
                    match self.held.get_mut(shard) {
                        Some(held) => held.merge(position.clone()),
                        None => {
                            self.held.insert(shard.to_owned(), position.clone());
                        }
                    }
                }
                known.merge(position)
            }
            None => {
                self.positions.insert(shard.to_owned(), position);
            }
        }
    }

    fn record_epoch(&mut self, group: &str, epoch: u64) {
        let known = self.epochs.entry(group.to_owned()).or_default();
        *known = (*known).max(epoch);
    }
}

/// The prefix of a map epoch in a session's text (`Customer=map:7`).
const MAP_EPOCH: &str = "map:";

impl fmt::Display for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seen = self.lock();
        let positions = seen
            .positions
            .iter()
            .map(|(shard, p)| format!("{shard}={p}"));
        let epochs = seen
            .epochs
            .iter()
            .map(|(group, e)| format!("{group}={MAP_EPOCH}{e}"));
        for (i, part) in positions.chain(epochs).enumerate() {
            if i > 0 {
                f.write_str(";")?;
            }
            f.write_str(&part)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Session({self})")
    }
}

/// Reads a session's text; refused with [`ShardError::InvalidSession`]
/// naming the part that is wrong. The empty text is an empty session.
impl FromStr for Session {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self> {
        let session = Session::new();
        for part in s.split(';').filter(|p| !p.is_empty()) {
            let invalid = |reason: String| ShardError::InvalidSession {
                reason: format!("{}: {reason}", Bounded(part)),
            };
            let (name, value) = part.split_once('=').ok_or_else(|| {
                invalid("expected `shard=position` or `group=map:epoch`".to_owned())
            })?;
            if name.is_empty() {
                return Err(invalid("the shard or group name is empty".to_owned()));
            }
            if name.chars().any(char::is_whitespace) {
                return Err(invalid(
                    "the shard or group name holds a space (no shard or group is named so)"
                        .to_owned(),
                ));
            }
            match value.strip_prefix(MAP_EPOCH) {
                Some(epoch) => {
                    let epoch = epoch
                        .parse::<u64>()
                        .map_err(|_| invalid(format!("{} is not a map epoch", Bounded(epoch))))?;
                    session.record_epoch(name, epoch);
                }
                None => {
                    let position = value.parse::<Position>().map_err(invalid)?;
                    session.record(name, position);
                }
            }
        }
        Ok(session)
    }
}

/// Which database may answer a read ([`Find::consistency`](crate::Find::consistency)).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Consistency {
    /// The shard itself (the default): every committed write is seen.
    #[default]
    Primary,
    /// Any replica of the shard whose last measured lag is at most
    /// `max_lag` (any replica that answers when `None`); the shard itself
    /// when none is. May return rows older than the latest commits.
    Replica {
        /// The largest lag accepted.
        max_lag: Option<Duration>,
    },
    /// Read-your-writes: a replica that has replayed past every commit
    /// recorded in the session for the shard read (waiting for one at most
    /// `[read] replica_wait_ms`), else the shard itself. Never older than
    /// the session's writes: a `movable` group's read on an instance whose
    /// bucket map is older than the one the session's commits were routed
    /// by reads the map first (a failure to read it fails the read).
    AtLeast(Session),
}

impl Consistency {
    /// [`Consistency::AtLeast`] a clone of `session` (which shares its
    /// positions).
    pub fn at_least(session: &Session) -> Self {
        Consistency::AtLeast(session.clone())
    }
}

/// Lag of a replica not yet measured, or failing.
const UNKNOWN: u64 = u64::MAX;

/// A replica as [`Cluster::replicas`](crate::Cluster::replicas) reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// The shard it replicates.
    pub shard: String,
    /// Its name.
    pub name: String,
    /// Its URL, password removed.
    pub url: String,
    /// Whether reads may use it now (it answered its last probe).
    pub in_rotation: bool,
    /// Its lag as last measured: none once it has replayed everything its
    /// shard had committed when probed; `None` when unknown (replay
    /// stopped, or the replica is out of the rotation).
    pub lag: Option<Duration>,
    /// Why it left the rotation, when it did.
    pub error: Option<String>,
}

/// One read replica: its pool and what the probe last measured.
pub(crate) struct Replica {
    pub(crate) name: String,
    pub(crate) conn: DatabaseConnection,
    /// Its URL, to scrub its secrets from what its driver said.
    pub(crate) url: crate::topology::DatabaseUrl,
    /// Why it last left the rotation.
    pub(crate) last_error: Mutex<Option<String>>,
    /// The last measured lag in milliseconds ([`UNKNOWN`] before the first
    /// good probe and after a failure).
    lag_ms: AtomicU64,
    /// Out of the rotation: it failed, and no probe has found it good
    /// since.
    down: AtomicBool,
    /// The position the last probe found it had replayed.
    replayed: Mutex<Option<Position>>,
    /// One per connection of its pool: a statement takes one before its
    /// bound starts, so the wait for a connection of a busy pool is told
    /// apart from a replica that does not answer ([`Replica::slot`]).
    slots: Arc<tokio::sync::Semaphore>,
}

impl Replica {
    /// A replica named `name` at `url`, `conn` its pool of `slots`
    /// connections.
    pub(crate) fn new(
        name: String,
        url: crate::topology::DatabaseUrl,
        conn: DatabaseConnection,
        slots: u32,
    ) -> Self {
        Replica {
            name,
            url,
            conn,
            lag_ms: AtomicU64::new(UNKNOWN),
            down: AtomicBool::new(false),
            last_error: Mutex::new(None),
            replayed: Mutex::new(None),
            slots: Arc::new(tokio::sync::Semaphore::new(slots.max(1) as usize)),
        }
    }

    /// A connection's turn on this replica, waited for at most `within`:
    /// `None` when every connection of its pool stays busy that long (the
    /// shard answers the read, and the replica stays in the rotation: a
    /// busy pool is not a replica that failed). Held for the statement.
    pub(crate) async fn slot(&self, within: Duration) -> Option<tokio::sync::OwnedSemaphorePermit> {
        if let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() {
            return Some(slot);
        }
        tokio::time::timeout(within, Arc::clone(&self.slots).acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// The last measured lag, if known.
    pub(crate) fn lag(&self) -> Option<Duration> {
        match self.lag_ms.load(Ordering::Acquire) {
            UNKNOWN => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Whether it is in the rotation.
    pub(crate) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Acquire)
    }

    /// Takes it out of the rotation until a good probe
    /// ([`measured`](Self::measured)), lag unknown.
    pub(crate) fn mark_down(&self, cause: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause);
        // What comes back may be another server (a rebuilt replica).
        *self.replayed.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.down.store(true, Ordering::Release);
        self.lag_ms.store(UNKNOWN, Ordering::Release);
        crate::metrics::replica_lag(&self.name, None);
    }

    /// A probe that could not measure the lag of a replica that is up (at
    /// its connection limit): it stays where it is, its lag unknown.
    pub(crate) fn lag_unknown(&self) {
        self.lag_ms.store(UNKNOWN, Ordering::Release);
        crate::metrics::replica_lag(&self.name, None);
    }

    /// A good probe: back in the rotation with lag `lag`.
    pub(crate) fn measured(&self, lag: Option<Duration>) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.down.store(false, Ordering::Release);
        let ms = lag.map_or(UNKNOWN, |d| {
            d.as_millis().min(u128::from(UNKNOWN - 1)) as u64
        });
        self.lag_ms.store(ms, Ordering::Release);
        crate::metrics::replica_lag(&self.name, lag);
    }

    /// Remembers that it has replayed at least `position`.
    fn saw(&self, position: Position) {
        let mut known = self.replayed.lock().unwrap_or_else(|p| p.into_inner());
        match known.as_mut() {
            Some(have) => have.merge(position),
            None => *known = Some(position),
        }
    }

    /// Whether it was last seen past `want` (by a probe or a wait): no
    /// statement.
    pub(crate) fn seen_past(&self, want: &Position) -> bool {
        self.replayed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|have| have.covers(want))
    }

    /// Whether it has replayed past `want`, waiting at most `wait` for it.
    pub(crate) async fn reached(
        &self,
        want: &Position,
        wait: Duration,
    ) -> std::result::Result<bool, sea_orm::DbErr> {
        if want.is_unreachable() {
            return Ok(false);
        }
        // Replay only moves forward: a position seen before is still
        // passed, and asking costs nothing.
        if self.seen_past(want) {
            return Ok(true);
        }
        let backend = self.conn.get_database_backend();
        match want {
            Position::Gtid(map) => {
                let stmt = Statement::from_sql_and_values(
                    backend,
                    "SELECT MASTER_GTID_WAIT(?, ?) AS w",
                    [Position::gtid_text(map).into(), wait.as_secs_f64().into()],
                );
                let row = self.conn.query_one_raw(stmt).await?;
                let waited: Option<i64> = match row {
                    Some(row) => row.try_get("", "w")?,
                    None => None,
                };
                if waited == Some(0) {
                    self.saw(want.clone());
                }
                Ok(waited == Some(0))
            }
            Position::Lsn(_) => {
                let deadline = tokio::time::Instant::now() + wait;
                let mut pause = Duration::from_millis(2);
                loop {
                    // Each look takes a connection's turn, waited for
                    // within the wait: a pool busy that long is "not yet",
                    // not a replica that does not answer.
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    let Some(slot) = self.slot(left).await else {
                        return Ok(false);
                    };
                    let replayed = self.replayed().await;
                    drop(slot);
                    if let Some(have) = replayed?
                        && have.covers(want)
                    {
                        self.saw(have);
                        return Ok(true);
                    }
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        return Ok(false);
                    }
                    tokio::time::sleep(pause.min(deadline - now)).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
            }
        }
    }

    /// The position it has replayed up to.
    async fn replayed(&self) -> std::result::Result<Option<Position>, sea_orm::DbErr> {
        let sql = match self.conn.get_database_backend() {
            // A promoted server keeps its last replayed position: none
            // once it is out of recovery.
            DbBackend::Postgres => {
                "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text END AS p"
            }
            _ => "SELECT @@gtid_slave_pos AS p",
        };
        read_position(&self.conn, sql).await
    }

    /// Measures its lag against its primary's position `primary`: none
    /// once it has replayed that far, else the age of the last transaction
    /// it replayed (PostgreSQL) or `Seconds_Behind_Master` (MariaDB/MySQL);
    /// `None` when the replica cannot say (replay stopped).
    pub(crate) async fn measure(
        &self,
        primary: Option<&Position>,
    ) -> std::result::Result<Option<Duration>, sea_orm::DbErr> {
        // The probe's reading replaces what was remembered: a replica
        // that restarted behind its old position is believed again.
        let have = self.replayed().await?;
        if have.is_none() && self.conn.get_database_backend() == DbBackend::Postgres {
            // `pg_last_wal_replay_lsn()` is NULL outside recovery: a
            // promoted server, no longer a replica of its shard.
            return Err(sea_orm::DbErr::Custom(
                "not in recovery: the server is no longer a replica".to_owned(),
            ));
        }
        *self.replayed.lock().unwrap_or_else(|p| p.into_inner()) = have.clone();
        if let (Some(primary), Some(have)) = (primary, have)
            && have.covers(primary)
        {
            return Ok(Some(Duration::ZERO));
        }
        let backend = self.conn.get_database_backend();
        match backend {
            DbBackend::Postgres => {
                let row = self
                    .conn
                    .query_one_raw(Statement::from_string(
                        backend,
                        "SELECT (EXTRACT(EPOCH FROM (now() - pg_last_xact_replay_timestamp())) \
                         * 1000)::float8 AS ms",
                    ))
                    .await?;
                let ms: Option<f64> = match row {
                    Some(row) => row.try_get("", "ms")?,
                    None => None,
                };
                Ok(ms.map(|ms| Duration::from_millis(ms.max(0.0) as u64)))
            }
            _ => {
                let row = self
                    .conn
                    .query_one_raw(Statement::from_string(backend, "SHOW SLAVE STATUS"))
                    .await?;
                // Unsigned on MariaDB, signed on some servers: either.
                let column = "Seconds_Behind_Master";
                let secs: Option<u64> = match row {
                    Some(row) => match row.try_get::<Option<u64>>("", column) {
                        Ok(secs) => secs,
                        Err(_) => row
                            .try_get::<Option<i64>>("", column)?
                            .map(|s| s.max(0) as u64),
                    },
                    // No replication configured: a server of its own (the
                    // primary itself, another database server), not a
                    // replica of its shard.
                    None => {
                        return Err(sea_orm::DbErr::Custom(
                            "no replication configured (SHOW SLAVE STATUS is empty): the server \
                             is not a replica"
                                .to_owned(),
                        ));
                    }
                };
                Ok(secs.map(Duration::from_secs))
            }
        }
    }
}

/// A shard's replicas, taken in turn.
#[derive(Default)]
pub(crate) struct ReplicaSet {
    pub(crate) replicas: Vec<Replica>,
    next: AtomicUsize,
    /// The position a replica must have replayed to answer for a `movable`
    /// group: the shard's position when this instance last installed a
    /// newer bucket map, so past every copy a move made before its
    /// cut-over (`None` before any map was installed).
    floor: Mutex<Option<Position>>,
    /// Bumped by every raise, so a probe replaces an unreachable floor
    /// only with a position read after that floor was set.
    floor_raises: AtomicU64,
}

impl ReplicaSet {
    pub(crate) fn new(replicas: Vec<Replica>) -> Self {
        ReplicaSet {
            replicas,
            next: AtomicUsize::new(0),
            floor: Mutex::new(None),
            floor_raises: AtomicU64::new(0),
        }
    }

    /// How many times the floor was raised (see [`raise_floor`](Self::raise_floor)).
    pub(crate) fn floor_raises(&self) -> u64 {
        self.floor_raises.load(Ordering::Acquire)
    }

    /// Replaces an unreachable floor with `position`, read after the floor
    /// had been raised `raises` times: a position read before an install
    /// that could not read its own must not stand in for it.
    pub(crate) fn settle_floor(&self, position: Position, raises: u64) {
        let mut floor = self.floor.lock().unwrap_or_else(|p| p.into_inner());
        if self.floor_raises.load(Ordering::Acquire) == raises
            && floor.as_ref().is_some_and(Position::is_unreachable)
        {
            *floor = Some(position);
        }
    }

    /// The position replicas must have replayed to answer for a movable
    /// group; `None`: they may not (no map installed yet).
    pub(crate) fn floor(&self) -> Option<Position> {
        self.floor.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Raises the floor to `position`; an unreachable floor is replaced.
    pub(crate) fn raise_floor(&self, position: Position) {
        let mut floor = self.floor.lock().unwrap_or_else(|p| p.into_inner());
        self.floor_raises.fetch_add(1, Ordering::AcqRel);
        match floor.as_mut() {
            Some(known) if !known.is_unreachable() => known.merge(position),
            _ => *floor = Some(position),
        }
    }

    /// The replicas in the rotation whose lag is within `max_lag` (any
    /// lag, even unknown, when `None`), starting with the next in turn.
    pub(crate) fn candidates(&self, max_lag: Option<Duration>) -> impl Iterator<Item = &Replica> {
        self.candidates_from(self.turn(), max_lag)
    }

    /// Whose turn it is to be asked first (the rotation moves on by one);
    /// a read that looks at the replicas twice takes one turn for both.
    pub(crate) fn turn(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// [`candidates`](Self::candidates) starting with turn `turn`: the
    /// turns go round the replicas that qualify, so the one after a replica
    /// out of the rotation is not asked first twice as often as the others.
    pub(crate) fn candidates_from(
        &self,
        turn: usize,
        max_lag: Option<Duration>,
    ) -> impl Iterator<Item = &Replica> {
        let n = self.replicas.len();
        let qualifies = move |r: &Replica| {
            r.is_up() && max_lag.is_none_or(|max| r.lag().is_some_and(|lag| lag <= max))
        };
        let eligible = self.replicas.iter().filter(|r| qualifies(r)).count();
        let start = match eligible {
            0 => 0,
            m => self
                .replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| qualifies(r))
                .nth(turn % m)
                .map_or(0, |(i, _)| i),
        };
        (0..n)
            .map(move |i| &self.replicas[(start + i) % n])
            .filter(move |r| qualifies(r))
    }
}

#[cfg(test)]
mod tests {
    use super::{Position, Replica, ReplicaSet, Session};
    use sea_orm::DbBackend;

    /// Reads that look at the replicas twice (a session's read: one already
    /// past its position, then the wait) take turns like the others: the
    /// first asked alternates between two replicas.
    #[test]
    fn replicas_are_asked_first_in_turn_as_often_as_each_other() {
        let replica = |name: &str| {
            Replica::new(
                name.to_owned(),
                crate::topology::DatabaseUrl::new(format!("postgres://{name}")),
                sea_orm::DatabaseConnection::default(),
                1,
            )
        };
        let set = ReplicaSet::new(vec![replica("a"), replica("b")]);
        let first: Vec<_> = (0..4)
            .map(|_| {
                let turn = set.turn();
                let _already = set.candidates_from(turn, None).next();
                set.candidates_from(turn, None)
                    .next()
                    .map(|r| r.name.clone())
            })
            .collect();
        let names = |n: [&str; 4]| n.map(|s| Some(s.to_owned())).to_vec();
        assert_eq!(first, names(["a", "b", "a", "b"]));
        // Reads that look once rotate the same way.
        let once: Vec<_> = (0..4)
            .map(|_| set.candidates(None).next().map(|r| r.name.clone()))
            .collect();
        assert_eq!(once, names(["a", "b", "a", "b"]));
        // With one of three out of the rotation, the other two are asked
        // first in turn, as often as each other.
        let set = ReplicaSet::new(vec![replica("a"), replica("b"), replica("c")]);
        set.replicas[1].mark_down("refused".to_owned());
        let first: Vec<_> = (0..4)
            .map(|_| set.candidates(None).next().map(|r| r.name.clone()))
            .collect();
        assert_eq!(first, names(["a", "c", "a", "c"]));
        // None in the rotation: none.
        set.replicas[0].mark_down("refused".to_owned());
        set.replicas[2].mark_down("refused".to_owned());
        assert!(set.candidates(None).next().is_none());
    }

    #[test]
    fn an_unreachable_floor_is_settled_only_by_a_later_position() {
        let set = ReplicaSet::new(Vec::new());
        let before = set.floor_raises();
        set.raise_floor(Position::Lsn(10));
        set.raise_floor(Position::unreachable(DbBackend::Postgres));
        // Read before the unreachable raise: refused.
        set.settle_floor(Position::Lsn(5), before);
        assert!(set.floor().is_some_and(|f| f.is_unreachable()));
        // Read after it: stands in.
        set.settle_floor(Position::Lsn(20), set.floor_raises());
        assert_eq!(set.floor(), Some(Position::Lsn(20)));
        // A reachable floor is never lowered by a settle.
        set.settle_floor(Position::Lsn(1), set.floor_raises());
        assert_eq!(set.floor(), Some(Position::Lsn(20)));
        assert!(!Position::Gtid(Default::default()).fits(DbBackend::Postgres));
        assert!("pg:100000000/0".parse::<Position>().is_err());
    }

    /// A position a commit could not read stands until a position read
    /// after it (a later commit's) replaces it; one read before it (a
    /// commit at the same time) does not, nor does a merge.
    #[test]
    fn an_unreachable_position_gives_way_to_one_read_after_it() {
        let s = Session::new();
        let before = s.mark();
        s.record("s0", Position::unreachable(DbBackend::Postgres));
        s.record_read_after("s0", Position::Lsn(7), before);
        assert!(s.position("s0").is_some_and(|p| p.is_unreachable()));
        let other: Session = "s0=pg:0/9".parse().unwrap();
        s.merge(&other);
        assert!(s.position("s0").is_some_and(|p| p.is_unreachable()));
        let after = s.mark();
        s.record_read_after("s0", Position::Lsn(8), after);
        // The position merged in while it was unreachable is kept too.
        assert_eq!(s.position("s0"), Some(Position::Lsn(9)));
        // Then positions merge as before.
        s.record_read_after("s0", Position::Lsn(6), s.mark());
        assert_eq!(s.position("s0"), Some(Position::Lsn(9)));
        // Carried as text, the unreachable position counts from the parse.
        let carried: Session = format!("s1={}", Position::unreachable(DbBackend::MySql))
            .parse()
            .unwrap();
        let since = carried.mark();
        carried.record_read_after("s1", "gtid:0-1-5".parse().unwrap(), since);
        assert_eq!(carried.to_string(), "s1=gtid:0-1-5");
    }

    /// Another request's commit, merged in after this one's position was
    /// read and before it replaced the unreachable position, is not lost.
    #[test]
    fn a_position_merged_in_while_unreachable_outlives_its_replacement() {
        let s = Session::new();
        s.record("s0", Position::unreachable(DbBackend::Postgres));
        let since = s.mark();
        // This request reads 0/800; another request's commit lands at
        // 0/900 and its session is merged into this one.
        let other: Session = "s0=pg:0/900".parse().unwrap();
        s.merge(&other);
        s.record_read_after("s0", Position::Lsn(0x800), since);
        assert_eq!(s.position("s0"), Some(Position::Lsn(0x900)));
        // MariaDB's GTID positions, per domain.
        let s = Session::new();
        s.record("s1", Position::unreachable(DbBackend::MySql));
        let since = s.mark();
        s.merge(&"s1=gtid:0-1-9,1-2-3".parse().unwrap());
        s.record_read_after("s1", "gtid:0-1-8".parse().unwrap(), since);
        assert_eq!(s.to_string(), "s1=gtid:0-1-9,1-2-3");
    }

    #[test]
    fn positions_and_sessions_round_trip_and_merge() {
        let s: Session = "s0=pg:16/B374D848;s1=gtid:0-1-42,1-2-7".parse().unwrap();
        assert_eq!(s.to_string(), "s0=pg:16/B374D848;s1=gtid:0-1-42,1-2-7");
        s.record("s0", "pg:16/B374D800".parse().unwrap());
        assert_eq!(s.position("s0"), Some(Position::Lsn(0x16_B374_D848)));
        s.record("s1", "gtid:0-1-43".parse().unwrap());
        assert_eq!(s.to_string(), "s0=pg:16/B374D848;s1=gtid:0-1-43,1-2-7");
        let have: Position = "gtid:0-1-43,1-2-6".parse().unwrap();
        assert!(!have.covers(&s.position("s1").unwrap()));
        assert!("".parse::<Session>().unwrap().is_empty());
        // Map epochs: the largest one stays, merged or recorded; a group
        // may share a shard's name.
        let m: Session = "Customer=map:7;s0=map:2".parse().unwrap();
        m.record_epoch("Customer", 5);
        assert_eq!(m.epoch("Customer"), Some(7));
        s.merge(&m);
        s.record_epoch("Customer", 9);
        assert_eq!(
            s.to_string(),
            "s0=pg:16/B374D848;s1=gtid:0-1-43,1-2-7;Customer=map:9;s0=map:2"
        );
        let back: Session = s.to_string().parse().unwrap();
        assert_eq!(back.to_string(), s.to_string());
        assert_eq!((back.epoch("s0"), back.epoch("Order")), (Some(2), None));
        assert!(!"Customer=map:1".parse::<Session>().unwrap().is_empty());
        // A domain given twice: its later position.
        let twice: Session = "s1=gtid:0-1-42,0-1-7".parse().unwrap();
        assert_eq!(twice.to_string(), "s1=gtid:0-1-42");
        // The caller's text is quoted, escaped and cut in the error.
        let long = format!("s0=pg:{}", "\n".repeat(10_000));
        let err = long.parse::<Session>().unwrap_err().to_string();
        assert!(err.len() < 400 && !err.contains('\n'), "{err}");
        for bad in [
            "s0",
            " s1=pg:0/1",
            "=pg:0/1",
            "s0=pg:xyz",
            "s0=redis:1",
            "s0=gtid:0-1",
            "Customer=map:",
            "Customer=map:-1",
            "=map:3",
        ] {
            let err = bad.parse::<Session>().unwrap_err();
            assert!(
                matches!(err, crate::ShardError::InvalidSession { .. }),
                "{bad}: {err}"
            );
        }
    }
}
