//! Who answers a read, a replica or the shard itself ([`ReadOn`]); the
//! replicas' lag probe; and where a commit landed, for sessions.

use crate::exec::periodic::{FirstPass, spawn};
use crate::exec::replicas::{
    Consistency, Position, Replica, ReplicaSet, ReplicaStatus, primary_position,
};
use crate::exec::shards::Shards;
use crate::topology::ShardId;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

/// One read's time on the shards, from when its first statement is
/// chosen: a read's timeout bounds the whole of it, whoever answers. A
/// replica (the wait for a session, then its answer) may take at most half
/// of it, and the shard answers within what is left, so a replica that
/// hangs costs the read half its timeout, not a second timeout on top.
pub(crate) struct ReadTime {
    timeout: Option<Duration>,
    /// When it began, for a read with a timeout that a replica may answer
    /// (a read of the primary reads no clock for it).
    started: Option<tokio::time::Instant>,
}

impl ReadTime {
    /// A read under `consistency` with `timeout` (none: unbounded)
    /// beginning now.
    pub(crate) fn start(timeout: Option<Duration>, consistency: &Consistency) -> Self {
        let replica = !matches!(consistency, Consistency::Primary);
        ReadTime {
            timeout,
            started: (replica && timeout.is_some()).then(tokio::time::Instant::now),
        }
    }

    /// A stream with `timeout` beginning now: its opening and first row
    /// share the timeout whoever answers (the clock is read for a stream of
    /// the primary too).
    pub(crate) fn start_stream(timeout: Option<Duration>) -> Self {
        ReadTime {
            timeout,
            started: timeout.map(|_| tokio::time::Instant::now()),
        }
    }

    /// When the replica's part ends, for a read with a timeout (none for a
    /// timeout too large to fall within the clock's range).
    pub(crate) fn replica_until(&self) -> Option<tokio::time::Instant> {
        self.started?.checked_add(self.timeout? / 2)
    }

    /// How long a replica may take to answer now: the replica timeout, or
    /// less when what is left of the replica's part of the read's timeout
    /// is shorter ([`Within::cut`]).
    pub(crate) fn replica_within(&self, shards: &Shards) -> Within {
        let own = shards.replica_timeout();
        let left = self
            .replica_until()
            .map(|until| until.saturating_duration_since(tokio::time::Instant::now()));
        match left {
            Some(left) if left < own => Within {
                bound: left,
                cut: true,
            },
            _ => Within {
                bound: own,
                cut: false,
            },
        }
    }

    /// A turn on `replica` for one statement of a read of shard `shard`: a
    /// connection's slot, taken before the statement's bound starts
    /// (waiting for a connection of a busy pool is not the replica failing
    /// to answer), and that bound. `None` when the shard must answer, the
    /// fallback counted with its reason: `timeout` (too little of the
    /// read's time left), `busy` (no slot within the bound) or `down` (out
    /// of the rotation meanwhile: the reads ahead found it hung).
    pub(crate) async fn replica_turn(
        &self,
        shards: &Shards,
        replica: &Replica,
        shard: &str,
    ) -> Option<(tokio::sync::OwnedSemaphorePermit, Within)> {
        let within = self.replica_within(shards);
        let why = if within.too_short() {
            "timeout"
        } else {
            match replica.slot(within.bound).await {
                None => "busy",
                Some(_) if !replica.is_up() => "down",
                Some(slot) => {
                    let within = self.replica_within(shards);
                    if !within.too_short() {
                        return Some((slot, within));
                    }
                    "timeout"
                }
            }
        };
        crate::metrics::replica_fallback(shard, why);
        None
    }

    /// What is left of the read's timeout for the shard, if it has one.
    pub(crate) fn left(&self) -> Option<Duration> {
        let timeout = self.timeout?;
        let end = self
            .started
            .and_then(|started| started.checked_add(timeout));
        Some(end.map_or(timeout, |end| {
            end.saturating_duration_since(tokio::time::Instant::now())
        }))
    }

    /// Runs `fut`, the shard's part of the read, under what is left of the
    /// read's timeout; a `Timeout` names the read's whole timeout.
    pub(crate) async fn on_shard<T>(
        &self,
        shards: &Shards,
        id: ShardId,
        group: &'static str,
        fut: impl std::future::Future<Output = crate::error::Result<T>>,
    ) -> crate::error::Result<T> {
        let out = shards.bounded(id, group, self.left(), fut).await;
        match self.timeout {
            Some(timeout) => out.map_err(|e| e.timed_out_after(timeout)),
            None => out,
        }
    }
}

/// How long a replica may take to answer one statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Within {
    pub(crate) bound: Duration,
    /// The read's timeout, not the replica timeout, set the bound: a
    /// replica that does not answer within it is not taken for a failed
    /// one (the shard answers, and the replica stays in the rotation).
    pub(crate) cut: bool,
}

impl Within {
    /// What the read's timeout leaves is too short to ask a replica at
    /// all: the shard answers at once.
    pub(crate) fn too_short(&self) -> bool {
        self.cut && self.bound < MIN_REPLICA_TIME
    }
}

/// The least time worth giving a replica for a statement (a round trip
/// on a loaded network, with room for the statement).
const MIN_REPLICA_TIME: Duration = Duration::from_millis(20);

/// How much of `left` a session's wait leaves for the replica's answer:
/// a quarter, at least 50 ms (or half of `left` when shorter), at most the
/// replica timeout. A replica that is only behind then answers "not yet"
/// within `left`, and is not taken for a hung one.
fn answer_margin(left: Duration, replica_timeout: Duration) -> Duration {
    (left / 4)
        .max(Duration::from_millis(50).min(left / 2))
        .min(replica_timeout)
}

/// The bound of a session's wait on one replica begun at `now` with
/// `left` of the choice's time: the wait, then the replica timeout, within
/// `left`; and whether it was cut short of that (by the read's own
/// deadline `until`, or by the time replicas before it took from the
/// choice), when a replica that does not answer in time has not failed.
/// (The first replica's `left` falls short of its own bound only by the
/// moments since the choice began: that is not a cut, however slow the
/// machine.)
fn wait_bound(
    now: tokio::time::Instant,
    left: Duration,
    waited: Duration,
    replica_timeout: Duration,
    until: Option<tokio::time::Instant>,
    first: bool,
) -> (Duration, bool) {
    let own = waited + replica_timeout;
    let bound = own.min(left);
    let cut =
        until.is_some_and(|until| until < now + own) || (!first && bound + MIN_REPLICA_TIME < own);
    (bound, cut)
}

/// Where a read runs.
pub(crate) enum ReadOn<'a> {
    /// The shard itself.
    Primary,
    /// One of its replicas.
    Replica(&'a Replica),
}

impl Shards {
    /// Who answers a read of `group` on shard `id` under `consistency`:
    /// the shard itself when it has no replica in the rotation that
    /// satisfies the consistency. For a `movable` group a replica must
    /// also have replayed past the shard's floor (its position when this
    /// instance installed its bucket map), so it holds every row a move
    /// copied there before the cut-over the map reflects. A session's
    /// wait for a replica ends by `until` (the replica's part of a read's
    /// timeout, [`ReadTime`]) when there is one.
    pub(crate) async fn read_on(
        &self,
        id: ShardId,
        group: &'static str,
        consistency: &Consistency,
        until: Option<tokio::time::Instant>,
    ) -> ReadOn<'_> {
        let set = &self.inner.replicas[id.index()];
        if set.replicas.is_empty() || matches!(consistency, Consistency::Primary) {
            return ReadOn::Primary;
        }
        let shard = self.shard_name(id);
        let floor = if self.topology().is_movable(group) {
            match set.floor() {
                Some(floor) if !floor.is_unreachable() => Some(floor),
                _ => {
                    crate::metrics::replica_fallback(shard, "movable");
                    return ReadOn::Primary;
                }
            }
        } else {
            None
        };
        let want = match consistency {
            Consistency::Primary => return ReadOn::Primary,
            Consistency::Replica { max_lag } => {
                let past_floor = |r: &&Replica| floor.as_ref().is_none_or(|f| r.seen_past(f));
                return match set.candidates(*max_lag).find(past_floor) {
                    Some(replica) => ReadOn::Replica(replica),
                    None => {
                        crate::metrics::replica_fallback(
                            shard,
                            if floor.is_some() { "movable" } else { "lag" },
                        );
                        ReadOn::Primary
                    }
                };
            }
            Consistency::AtLeast(session) => match (session.position(shard), floor) {
                (Some(mut want), Some(floor)) => {
                    want.merge(floor);
                    Some(want)
                }
                (want, floor) => want.or(floor),
            },
        };
        let Some(want) = want else {
            // Nothing of this session on the shard: any replica will do.
            return match set.candidates(None).next() {
                Some(replica) => ReadOn::Replica(replica),
                None => {
                    crate::metrics::replica_fallback(shard, "down");
                    ReadOn::Primary
                }
            };
        };
        // A session's text is the caller's: a position of another kind of
        // log than the shard's is answered by the shard, and no replica is
        // asked about it.
        let backend = self.shard_conn(id).get_database_backend();
        if !want.fits(backend) {
            crate::metrics::replica_fallback(shard, "behind");
            return ReadOn::Primary;
        }
        // One deadline for the whole choice, however many replicas fail.
        let wait = self.inner.read.replica_wait;
        let started = Instant::now();
        let replica_timeout = self.replica_timeout();
        let deadline = tokio::time::Instant::now() + wait + replica_timeout;
        let deadline = until.map_or(deadline, |until| until.min(deadline));
        // One turn for both looks, so the wait's first replica rotates too.
        let turn = set.turn();
        let already = set.candidates_from(turn, None).find(|r| r.seen_past(&want));
        if let Some(replica) = already {
            crate::metrics::token_wait(started.elapsed());
            return ReadOn::Replica(replica);
        }
        let mut busy = false;
        for (asked, replica) in set.candidates_from(turn, None).enumerate() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            // MariaDB's wait holds a connection throughout (PostgreSQL's
            // asks again and again, each a short statement that takes its
            // own turn): its pool busy that long, the next replica, else
            // the shard.
            let queued = tokio::time::Instant::now();
            let _slot = match &want {
                Position::Gtid(_) => match replica.slot(left.min(replica_timeout)).await {
                    Some(slot) => Some(slot),
                    None => {
                        busy = true;
                        continue;
                    }
                },
                Position::Lsn(_) => None,
            };
            // Out of the rotation meanwhile (the reads ahead found it
            // hung): not asked.
            if !replica.is_up() {
                continue;
            }
            let now = tokio::time::Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                break;
            }
            // The wait ends before the bound, so a replica that is only
            // behind answers "not yet" in time. Only a replica that misses
            // its own bound (the wait, then the replica timeout) has
            // failed; one cut off by the read's timeout has not.
            let waited = wait.min(left - answer_margin(left, replica_timeout));
            // A replica whose turn came late has less than its own bound
            // left, as one after another that failed: cut, not failed.
            let first = asked == 0 && now.duration_since(queued) < MIN_REPLICA_TIME;
            let (bound, cut) = wait_bound(now, left, waited, replica_timeout, until, first);
            let answer = tokio::time::timeout(bound, replica.reached(&want, waited)).await;
            match answer {
                Ok(Ok(true)) => {
                    crate::metrics::token_wait(started.elapsed());
                    return ReadOn::Replica(replica);
                }
                Ok(Ok(false)) => {
                    crate::metrics::token_wait(started.elapsed());
                    crate::metrics::replica_fallback(shard, "behind");
                    return ReadOn::Primary;
                }
                Ok(Err(err)) => self.replica_error(replica, &err),
                Err(_) if cut => {
                    crate::metrics::replica_fallback(shard, "timeout");
                    return ReadOn::Primary;
                }
                Err(_) => self.replica_failed(replica, &format_args!("no answer within {bound:?}")),
            }
        }
        crate::metrics::replica_fallback(shard, if busy { "busy" } else { "down" });
        ReadOn::Primary
    }

    /// Takes `replica` out of the rotation after it failed a read, a wait
    /// or a probe (refused, lost or hung); only a good probe puts it back
    /// (a timer would send reads to a replica that still refuses or hangs
    /// between two probes).
    pub(crate) fn replica_failed(&self, replica: &Replica, cause: &dyn std::fmt::Display) {
        let cause = replica.url.scrub(&cause.to_string());
        tracing::warn!(replica = %replica.name, %cause, "replica left the rotation");
        replica.mark_down(cause);
    }

    /// `replica` did not answer a read's statement `within` its bound: out
    /// of the rotation when that was the replica timeout; when the read's
    /// own timeout cut it shorter, the shard answers and the replica stays.
    pub(crate) fn replica_too_slow(&self, replica: &Replica, within: Within, shard: &str) {
        if within.cut {
            crate::metrics::replica_fallback(shard, "timeout");
        } else {
            let bound = within.bound;
            self.replica_failed(replica, &format_args!("no answer within {bound:?}"));
            crate::metrics::replica_fallback(shard, "failed");
        }
    }

    /// Runs `statement` on `replica` (a read of shard `shard`, in a turn
    /// from [`ReadTime::replica_turn`]) within its bound: its value, or
    /// `None` when the shard must answer. A replica that failed or did not
    /// answer within the replica timeout leaves the rotation
    /// ([`replica_error`](Self::replica_error),
    /// [`replica_too_slow`](Self::replica_too_slow)).
    pub(crate) async fn on_replica<T>(
        &self,
        replica: &Replica,
        within: Within,
        shard: &str,
        statement: impl std::future::Future<Output = Result<T, sea_orm::DbErr>>,
    ) -> Option<T> {
        match tokio::time::timeout(within.bound, statement).await {
            Ok(Ok(value)) => {
                crate::metrics::replica_read(shard, &replica.name);
                Some(value)
            }
            Ok(Err(err)) => {
                self.replica_error(replica, &err);
                crate::metrics::replica_fallback(shard, "failed");
                None
            }
            Err(_) => {
                self.replica_too_slow(replica, within, shard);
                None
            }
        }
    }

    /// A statement on `replica` failed: a lost or refused connection takes
    /// it out of the rotation; any other error (the statement's own, a
    /// server at its connection limit, a recovery conflict) does not, and
    /// the shard answers that read.
    pub(crate) fn replica_error(&self, replica: &Replica, err: &sea_orm::DbErr) {
        if crate::error::db_retry(err) == crate::Retry::Now {
            self.replica_failed(replica, &crate::error::DriverCause(err));
        } else {
            let cause = replica
                .url
                .scrub(&crate::error::DriverCause(err).to_string());
            tracing::debug!(replica = %replica.name, %cause, "replica read failed; the shard answers it");
        }
    }

    /// How long a replica may take to answer a read (a read with a timeout
    /// gives it less: [`ReadTime::replica_within`]).
    pub(crate) fn replica_timeout(&self) -> Duration {
        let bound = self.inner.read.replica_timeout;
        self.inner.read.timeout.map_or(bound, |t| t.min(bound))
    }

    /// Where shard `id`'s log is now, read on the shard after a commit
    /// (within the replica timeout): a replica that has replayed this far
    /// has the commit. Read for every PostgreSQL and MySQL/MariaDB shard,
    /// replicas or not here, since a session may be read by an instance
    /// whose config lists replicas; `None` on SQLite. A position that
    /// cannot be read is one no replica reaches.
    pub(crate) async fn commit_position(&self, id: ShardId) -> Option<Position> {
        let backend = self.shard_conn(id).get_database_backend();
        if backend == sea_orm::DbBackend::Sqlite {
            return None;
        }
        let bound = self.inner.read.replica_timeout;
        let read = tokio::time::timeout(bound, primary_position(self.side_conn(id))).await;
        let cause = match read {
            Ok(Ok(Some(position))) => return Some(position),
            Ok(Ok(None)) => "the shard reported no position".to_owned(),
            Ok(Err(err)) => crate::error::DriverCause(&err).to_string(),
            Err(_) => format!("no answer within {bound:?}"),
        };
        let url = &self.topology().shard(id).url;
        tracing::warn!(
            shard = self.shard_name(id),
            cause = %url.scrub(&cause),
            "commit position unknown: this session reads the shard itself"
        );
        Some(Position::unreachable(backend))
    }

    /// Starts measuring every replica's lag every `[read]
    /// replica_probe_ms`, when any shard has replicas.
    pub(crate) fn spawn_replica_probes(&self) {
        if self
            .inner
            .replicas
            .iter()
            .all(|set| set.replicas.is_empty())
        {
            return;
        }
        spawn(
            self,
            self.inner.read.replica_probe,
            FirstPass::Now,
            |shards| async move {
                shards.probe_replicas().await;
                ControlFlow::Continue(())
            },
        );
    }

    /// Raises every shard's replica floor to the shard's position now.
    /// Called before a newer bucket map is installed: the move that made
    /// it copied its rows and cut over before this reads the positions,
    /// so a replica past its floor has every row the new map routes to
    /// it. A shard whose position cannot be read gets a floor no replica
    /// reaches (its movable reads go to the shard) until a probe reads it.
    pub(crate) async fn raise_replica_floors(&self) {
        let raises = self.with_replicas().map(|(id, set)| async move {
            match self.position_now(id).await {
                Some(position) => set.raise_floor(position),
                None => {
                    let backend = self.shard_conn(id).get_database_backend();
                    set.raise_floor(Position::unreachable(backend));
                }
            }
        });
        futures::future::join_all(raises).await;
    }

    /// The shards that have replicas, with their replicas.
    fn with_replicas(&self) -> impl Iterator<Item = (ShardId, &ReplicaSet)> {
        self.inner
            .replicas
            .iter()
            .enumerate()
            .filter(|(_, set)| !set.replicas.is_empty())
            .map(|(i, set)| (ShardId(i as u32), set))
    }

    /// Shard `id`'s position now, within the replica timeout; `None` when
    /// it cannot be read.
    async fn position_now(&self, id: ShardId) -> Option<Position> {
        let bound = self.inner.read.replica_timeout;
        tokio::time::timeout(bound, primary_position(self.side_conn(id)))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    }

    /// Every replica's state after probing each once now.
    pub(crate) async fn replica_status(&self) -> Vec<ReplicaStatus> {
        self.probe_replicas().await;
        self.inner
            .replicas
            .iter()
            .zip(self.topology().shards())
            .flat_map(|(set, spec)| {
                set.replicas.iter().zip(&spec.replicas).map(move |(r, rs)| {
                    let error = r
                        .last_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone();
                    ReplicaStatus {
                        shard: spec.name.clone(),
                        name: r.name.clone(),
                        url: rs.url.redacted(),
                        in_rotation: r.is_up() && error.is_none(),
                        lag: r.lag(),
                        error,
                    }
                })
            })
            .collect()
    }

    /// One probe of every replica: its primary's position, then each
    /// replica's lag against it, each bounded by the replica timeout.
    async fn probe_replicas(&self) {
        let bound = self.inner.read.replica_timeout;
        let probes = self.with_replicas().map(|(id, set)| async move {
            let raises = set.floor_raises();
            let primary = self.position_now(id).await;
            // A floor the last map install could not read: the shard's
            // position now, read after that install, stands in for it.
            if let Some(position) = &primary {
                set.settle_floor(position.clone(), raises);
            }
            for replica in &set.replicas {
                // Reads keeping every connection busy: measured next time.
                let Some(_slot) = replica.slot(bound).await else {
                    continue;
                };
                match tokio::time::timeout(bound, replica.measure(primary.as_ref())).await {
                    Ok(Ok(lag)) => replica.measured(lag),
                    Ok(Err(err)) => self.replica_failed(replica, &crate::error::DriverCause(&err)),
                    // The pool retries a refused connection, and one the
                    // server refuses for its connection limit, until its
                    // acquire timeout: one connection of its own says which
                    // it was, with the driver's cause.
                    Err(_) => {
                        let health = crate::exec::health::ShardHealth::new(&replica.url, bound);
                        match health.connect_once().await {
                            // At its connection limit: up, and busy (the
                            // reads it cannot take go to the shard); its
                            // lag is not known now (reads with a lag bound
                            // go to the shard).
                            Err(crate::exec::health::ProbeFailure::Full(_)) => {
                                replica.lag_unknown();
                            }
                            Err(crate::exec::health::ProbeFailure::Down(cause)) => {
                                self.replica_failed(replica, &format_args!("probe: {cause}"));
                            }
                            Ok(()) => self.replica_failed(
                                replica,
                                &format_args!("probe: no answer within {bound:?}"),
                            ),
                        }
                    }
                }
            }
        });
        futures::future::join_all(probes).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any() -> Consistency {
        Consistency::Replica { max_lag: None }
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_s_timeout_is_shared_by_its_replica_and_its_shard() {
        let time = ReadTime::start(Some(Duration::from_millis(1000)), &any());
        let started = tokio::time::Instant::now();
        assert_eq!(
            time.replica_until(),
            Some(started + Duration::from_millis(500))
        );
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(time.left(), Some(Duration::from_millis(300)));
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(time.left(), Some(Duration::ZERO));
        // Reads of the primary and reads without a timeout read no clock.
        let primary = ReadTime::start(Some(Duration::from_secs(1)), &Consistency::Primary);
        assert_eq!(primary.replica_until(), None);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(primary.left(), Some(Duration::from_secs(1)));
        let unbounded = ReadTime::start(None, &any());
        assert_eq!((unbounded.replica_until(), unbounded.left()), (None, None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_past_the_clock_s_range_bounds_nothing_and_panics_nowhere() {
        let time = ReadTime::start(Some(Duration::MAX), &any());
        assert_eq!(time.replica_until(), None);
        assert_eq!(time.left(), Some(Duration::MAX));
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_read_s_own_deadline_cuts_a_session_s_wait() {
        let ms = Duration::from_millis;
        let start = tokio::time::Instant::now();
        // No read timeout: the choice's deadline (wait + replica timeout)
        // was set a moment before this replica's turn, so `left` is a
        // little short of the replica's own bound; still not cut.
        let now = start + ms(1);
        assert_eq!(
            wait_bound(now, ms(1499), ms(500), ms(1000), None, true),
            (ms(1499), false)
        );
        // On a machine that paused 30 ms before the first replica's turn.
        assert_eq!(
            wait_bound(start + ms(30), ms(1470), ms(500), ms(1000), None, true),
            (ms(1470), false)
        );
        // A read timeout whose half ends after the replica's own bound.
        let until = Some(start + ms(2500));
        assert_eq!(
            wait_bound(now, ms(1499), ms(500), ms(1000), until, true),
            (ms(1499), false)
        );
        // One whose half ends first: cut.
        let until = Some(start + ms(500));
        assert_eq!(
            wait_bound(now, ms(499), ms(374), ms(1000), until, true),
            (ms(499), true)
        );
        // A later replica, after one that failed 400 ms in: 1,100 ms left
        // of the choice, short of its own 1,500: cut, not failed.
        let later = start + ms(400);
        assert_eq!(
            wait_bound(later, ms(1100), ms(500), ms(1000), None, false),
            (ms(1100), true)
        );
    }

    #[test]
    fn a_session_s_wait_leaves_its_replica_time_to_answer() {
        let ms = Duration::from_millis;
        // A quarter of what is left, at least 50 ms (half when less is
        // left), at most the replica timeout.
        assert_eq!(answer_margin(ms(1500), ms(1000)), ms(375));
        assert_eq!(answer_margin(ms(500), ms(1000)), ms(125));
        assert_eq!(answer_margin(ms(100), ms(1000)), ms(50));
        assert_eq!(answer_margin(ms(60), ms(1000)), ms(30));
        assert_eq!(answer_margin(ms(2100), ms(100)), ms(100));
        assert_eq!(answer_margin(Duration::ZERO, ms(100)), Duration::ZERO);
    }
}
