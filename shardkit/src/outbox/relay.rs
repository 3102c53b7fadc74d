//! [`Outbox`]: the handle on the cluster's outboxes: the handlers this
//! instance applies, the relay that delivers every shard's messages, and
//! the operator's view (status, retry, discard).

use crate::cluster::{Cluster, ShardTx};
use crate::error::{Result, ShardError};
use crate::exec::keyed_tables::OUTBOX;
use crate::exec::periodic;
use crate::outbox::message::{BoxError, Delivery, Kind, Message, Row, SourceChange, Typed, db_err};
use crate::topology::ShardId;
use futures::StreamExt;
use futures::future::BoxFuture;
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{
    Alias, Expr, ExprTrait, Func, Order, OverStatement, Query, SimpleExpr, WindowStatement,
};
use serde::Serialize;
use std::collections::HashMap;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The longest any of a relay's durations is taken to be: a deadline
/// `Duration::MAX` away cannot be computed (an `Instant` overflows).
const LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

/// How the relay paces itself.
#[derive(Clone, Copy, Debug)]
struct Settings {
    poll: Duration,
    max_attempts: i32,
    first_backoff: Duration,
    max_backoff: Duration,
    batch: u64,
    parallel: usize,
    step_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            poll: Duration::from_millis(25),
            max_attempts: 8,
            first_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(60),
            batch: 500,
            parallel: 8,
            step_timeout: Duration::from_secs(10),
        }
    }
}

/// The cluster's outboxes ([`Cluster::outbox`]): register a handler per
/// message type ([`handle`](Self::handle)), then relay
/// ([`run`](Self::run) in the background, or [`deliver`](Self::deliver)
/// once); see `shardkit::guide::outbox`.
///
/// Delivery is at least once, and the effect exactly once: the handler's
/// transaction on the receiving key records the message id in that key's
/// inbox (`shardkit_inbox`), so a message delivered again (a relay that
/// died before it deleted the message, two relays at once) finds its id
/// there and is not applied twice. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    cluster: Cluster,
    kinds: Arc<HashMap<&'static str, Arc<dyn Kind>>>,
    settings: Settings,
    /// Per shard, when the running relay last counted its outbox (the
    /// gauges) and pruned it (ms).
    housekeeping: Arc<Mutex<HashMap<u32, [i64; 2]>>>,
    /// Per handler set, shard and sending key: when a read of the key's
    /// pairs ([`pair_heads`](Self::pair_heads)) by the running relay last
    /// applied nothing (ms).
    pair_reads: Arc<Mutex<HashMap<PairRead, i64>>>,
    /// This handle's set of handlers (a new number for each
    /// [`handle`](Self::handle) or [`message`](Self::message)): clones with
    /// other handlers keep windows and pair reads of their own.
    handlers: u64,
    /// The message types a pair was found waiting on that this relay does
    /// not know (warned once each).
    unknown: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Per handler set and shard, the sending key its next pass starts at
    /// (see [`Window`]); none: the top of the outbox.
    windows: Arc<Mutex<HashMap<(u64, u32), Window>>>,
    /// Per message, how many deliveries in a row this relay put off (a
    /// shard down, an abort): the wait doubles with each, as after failed
    /// attempts, without counting attempts (which would park it).
    put_off: Arc<Mutex<HashMap<String, i32>>>,
}

/// The most messages whose put-offs a relay counts (those put off are the
/// heads of their pairs; a message another process delivered leaves its
/// count here, so the counts are cleared past this).
const PUT_OFF_COUNTED: usize = 200_000;

/// Where a shard's next pass starts reading its pending messages. A pass
/// reads at most `PAGES` pages in the order of their sending keys; when
/// that is not all of them, the next pass goes on from the last sending
/// key it read (from that key's first message again, so every pair's
/// messages still go in order), and after the end, from the top. A backlog
/// of messages that cannot go now (put off, waiting behind one) therefore
/// never hides the sending keys after it for good.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Window {
    grp: String,
    key_text: String,
    /// Whether the key's own messages are read again: not when they alone
    /// filled the last pass, which would then never get past them.
    inclusive: bool,
}

/// Whether passes have read every pending message since they last changed
/// anything: then `deliver` stops.
#[derive(Default)]
struct Cycle {
    /// Every pass since one that began at the top changed nothing.
    quiet_from_top: bool,
}

impl Cycle {
    /// After a pass that began at the top (`top`) or not, changed something
    /// (`progressed`) or not, and read to the end (`end`) or not: whether
    /// to stop.
    fn done(&mut self, top: bool, progressed: bool, end: bool) -> bool {
        if top {
            self.quiet_from_top = true;
        }
        if progressed {
            self.quiet_from_top = false;
        }
        end && self.quiet_from_top
    }
}

/// What one pass over a shard did, and where in its outbox it read.
#[derive(Clone, Copy, Default)]
struct Pass {
    report: RelayReport,
    /// It began at the top of the outbox.
    top: bool,
    /// It read to the end (the next pass begins at the top).
    end: bool,
}

/// A sending key's pairs read by one handler set on one shard.
type PairRead = (u64, u32, String, String);

/// Numbers the handler sets of [`Outbox`] handles.
fn next_handler_set() -> u64 {
    static SETS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// How long a read of a sending key's pairs that applied nothing holds off
/// the next (ms): the read sorts the key's whole backlog.
const PAIR_READ_EVERY: i64 = 1_000;

/// Pages of pending messages a pass reads per shard, at most.
const PAGES: usize = 4;

/// Where [`Outbox::pending`] starts: after a row (the next page), or at a
/// pass's [`Window`].
#[derive(Clone, Copy)]
enum Start<'a> {
    After(&'a Row),
    Window(&'a Window),
}

pub use crate::exec::keyed_tables::INBOX_TTL;

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kinds: Vec<&str> = self.kinds.keys().copied().collect();
        kinds.sort_unstable();
        f.debug_struct("Outbox")
            .field("messages", &kinds)
            .field("settings", &self.settings)
            .finish()
    }
}

impl Cluster {
    /// The outboxes of every shard: messages sent by
    /// [`ShardTx::send`](crate::tx::ShardTx::send), the handlers that apply
    /// them, and the relay. The handle starts with no handler.
    pub fn outbox(&self) -> Outbox {
        Outbox {
            cluster: self.clone(),
            kinds: Arc::new(HashMap::new()),
            settings: Settings::default(),
            housekeeping: Arc::default(),
            pair_reads: Arc::default(),
            handlers: next_handler_set(),
            unknown: Arc::default(),
            windows: Arc::default(),
            put_off: Arc::default(),
        }
    }
}

/// What one relay pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RelayReport {
    /// Messages whose handler ran and committed.
    pub applied: u64,
    /// Messages found applied already (their id in the inbox) and deleted.
    pub duplicates: u64,
    /// Handler attempts that failed (to be tried again, or parked).
    pub failed: u64,
    /// Messages parked by this pass.
    pub parked: u64,
    /// Deliveries put off because a shard could not be reached.
    pub deferred: u64,
    /// Shards whose outbox could not be read.
    pub shards_failed: u64,
}

impl RelayReport {
    /// Whether the pass changed anything (applied, found applied, failed or
    /// parked a message): another pass may find more to do now.
    fn progressed(&self) -> bool {
        self.applied + self.duplicates + self.parked + self.failed > 0
    }

    pub(crate) fn add(&mut self, other: RelayReport) {
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        self.parked += other.parked;
        self.deferred += other.deferred;
        self.shards_failed += other.shards_failed;
    }
}

/// A message parked after its last attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ParkedMessage {
    /// The message id (for [`Outbox::retry`] and [`Outbox::discard`]).
    pub id: String,
    /// The message's name ([`Message::NAME`]).
    pub kind: String,
    /// The sending group and key (directory text).
    pub from: (String, String),
    /// The receiving group and key.
    pub to: (String, String),
    /// Attempts made.
    pub attempts: i32,
    /// The last attempt's error.
    pub last_error: Option<String>,
}

/// One shard's outbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShardOutbox {
    /// The shard.
    pub shard: String,
    /// Messages waiting to be applied.
    pub pending: u64,
    /// When the oldest pending message was sent (milliseconds since the
    /// Unix epoch, the cluster's clock).
    pub oldest_pending_ms: Option<i64>,
    /// Parked messages (at most 100 listed).
    pub parked: Vec<ParkedMessage>,
    /// Parked messages in all.
    pub parked_count: u64,
    /// Why the shard's outbox could not be read.
    pub error: Option<String>,
}

/// Every shard's outbox ([`Outbox::status`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutboxStatus {
    /// Per shard, in the config's order.
    pub shards: Vec<ShardOutbox>,
}

/// A relay running in the background ([`Outbox::run`]). It stops when the
/// cluster's last handle is dropped, or at [`stop`](Self::stop); dropping
/// this handle leaves it running.
#[derive(Debug)]
pub struct RelayTask {
    /// One per shard.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RelayTask {
    /// Stops the relay (a delivery in flight rolls back; its message is
    /// delivered again later, and applied once).
    pub fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
    }

    /// Whether it has stopped.
    pub fn is_finished(&self) -> bool {
        self.tasks.iter().all(|t| t.is_finished())
    }
}

impl Outbox {
    /// Registers `handler` for message type `M`: the relay applies each
    /// `M` by running it inside a transaction of the receiving key (a
    /// [`ShardTx`] behind an `Arc`, as in
    /// [`Cluster::transaction`]), with the message id recorded in
    /// the key's inbox in the same transaction. `Ok` commits; an error
    /// rolls everything back and the message is tried again after a
    /// backoff, and parked after [`max_attempts`](Self::max_attempts)
    /// (errors of a shard that cannot be reached do not count).
    pub fn handle<M, F, Fut, E>(mut self, handler: F) -> Self
    where
        M: Message,
        F: Fn(Arc<ShardTx<M::To>>, M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let handler = Arc::new(handler);
        let typed = Typed::<M> {
            handler: Some(Arc::new(move |tx, m| {
                let fut = handler(tx, m);
                Box::pin(async move { fut.await.map_err(Into::into) })
            })),
        };
        Arc::make_mut(&mut self.kinds).insert(M::NAME, Arc::new(typed));
        self.handlers = next_handler_set();
        self
    }

    /// Makes message type `M` known without a handler (an operator's tool
    /// that lists, retries and discards messages, but applies none).
    pub fn message<M: Message>(mut self) -> Self {
        let kinds = Arc::make_mut(&mut self.kinds);
        kinds
            .entry(M::NAME)
            .or_insert_with(|| Arc::new(Typed::<M> { handler: None }));
        self.handlers = next_handler_set();
        self
    }

    /// How long the running relay waits between passes that found nothing
    /// to deliver (default 25 ms).
    pub fn poll_every(mut self, every: Duration) -> Self {
        self.settings.poll = every.clamp(Duration::from_millis(1), LONGEST);
        self
    }

    /// Failed attempts after which a message is parked (default 8, at
    /// least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts.clamp(1, i32::MAX as u32) as i32;
        self
    }

    /// The wait after the first failed attempt, doubled after each
    /// further one up to `max` (default 200 ms up to 60 s; each at most a
    /// year).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.first_backoff = first.min(LONGEST);
        self.settings.max_backoff = max.clamp(self.settings.first_backoff, LONGEST);
        self
    }

    /// The longest a relay waits for one shard's step (reading its outbox,
    /// applying one receiving key's messages) before it gives up on it for
    /// this pass (default 10 s, at most a year: `Duration::MAX` for "no
    /// bound" is taken as a year): a shard that hangs holds nothing else up.
    /// A message not applied within it is put off by the backoff, without
    /// counting an attempt.
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.settings.step_timeout = timeout.min(LONGEST);
        self
    }

    /// Runs the relay in the background: one task per shard, each a pass
    /// over its shard's outbox, again at once while passes find work, else
    /// every [`poll_every`](Self::poll_every) (a slow or hung shard holds
    /// up only its own messages). It follows the live bucket map, holds no
    /// user handle of the cluster between passes, and stops with the
    /// cluster (or at [`RelayTask::stop`]).
    pub fn run(&self) -> RelayTask {
        let shards = self.cluster.shards().topology().shards().len() as u32;
        let tasks = (0..shards)
            .map(|i| {
                let kinds = Arc::clone(&self.kinds);
                let settings = self.settings;
                let housekeeping = Arc::clone(&self.housekeeping);
                let windows = Arc::clone(&self.windows);
                let pair_reads = Arc::clone(&self.pair_reads);
                let unknown = Arc::clone(&self.unknown);
                let put_off = Arc::clone(&self.put_off);
                let handlers = self.handlers;
                periodic::spawn(
                    &self.cluster,
                    settings.poll,
                    periodic::FirstPass::Now,
                    move |cluster: Cluster| {
                        let relay = Outbox {
                            cluster,
                            kinds: Arc::clone(&kinds),
                            settings,
                            housekeeping: Arc::clone(&housekeeping),
                            windows: Arc::clone(&windows),
                            pair_reads: Arc::clone(&pair_reads),
                            handlers,
                            unknown: Arc::clone(&unknown),
                            put_off: Arc::clone(&put_off),
                        };
                        async move {
                            // Again at once while passes change something;
                            // a pass that changed nothing still moved the
                            // shard's window, so the next poll reads on from
                            // there (one window per poll: a backlog that
                            // cannot go is not read whole every 25 ms).
                            loop {
                                let pass = relay.pass_shard(ShardId(i), true).await;
                                if !pass.report.progressed() {
                                    break;
                                }
                            }
                            relay.housekeeping(ShardId(i)).await;
                            ControlFlow::Continue(())
                        }
                    },
                )
            })
            .collect();
        RelayTask { tasks }
    }

    /// Delivers every message that can be delivered now, pass after pass
    /// until a pass finds nothing more; returns what was done.
    pub async fn deliver(&self) -> Result<RelayReport> {
        let mut total = RelayReport::default();
        let count = self.cluster.shards().topology().shards().len();
        // Each shard's passes until they have read its whole outbox since
        // they last changed anything. Any change starts every shard's count
        // again (a handler may send a message from the key it received on,
        // into another shard's outbox); a shard that could not be read is
        // not waited for.
        let mut cycles: Vec<Option<Cycle>> = (0..count).map(|_| Some(Cycle::default())).collect();
        let mut unread = vec![false; count];
        loop {
            let ids: Vec<ShardId> = (0..count as u32)
                .map(ShardId)
                .filter(|id| cycles[id.0 as usize].is_some())
                .collect();
            if ids.is_empty() {
                return Ok(total);
            }
            let passes = self.pass(ids.clone()).await;
            let mut progressed = false;
            for (id, pass) in ids.into_iter().zip(passes) {
                total.add(pass.report);
                progressed |= pass.report.progressed();
                let i = id.0 as usize;
                unread[i] = pass.report.shards_failed > 0;
                if unread[i]
                    || cycles[i].as_mut().is_some_and(|cycle| {
                        cycle.done(pass.top, pass.report.progressed(), pass.end)
                    })
                {
                    cycles[i] = None;
                }
            }
            if progressed {
                for (cycle, unread) in cycles.iter_mut().zip(&unread) {
                    if cycle.is_none() && !unread {
                        *cycle = Some(Cycle::default());
                    }
                }
            }
        }
    }

    /// One pass over each of `ids`' outboxes, the shards at once.
    fn pass(&self, ids: Vec<ShardId>) -> BoxFuture<'_, Vec<Pass>> {
        Box::pin(futures::future::join_all(
            ids.into_iter().map(|id| self.pass_shard(id, false)),
        ))
    }

    /// One pass over shard `id`'s outbox; `running`: a pass of the running
    /// relay, whose reads of a backlogged key's pairs are held off after
    /// one that applied nothing (`deliver` reads them every time).
    async fn pass_shard(&self, id: ShardId, running: bool) -> Pass {
        let shards = self.cluster.shards();
        let name = shards.shard_name(id).to_owned();
        let mut report = RelayReport::default();
        // A handle with no handler (an operator's) applies nothing.
        if !self.kinds.values().any(|k| k.has_handler()) {
            return Pass {
                report,
                top: true,
                end: true,
            };
        }
        let window = self.lock_windows().get(&(self.handlers, id.0)).cloned();
        // Pages of pending messages, so that a full page of messages that
        // cannot go now (put off, or a pair waiting behind one) does not
        // hide the rest of the window.
        let mut rows = Vec::new();
        let mut end = false;
        for _ in 0..PAGES {
            let from = if rows.is_empty() {
                window.as_ref().map(Start::Window)
            } else {
                rows.last().map(Start::After)
            };
            match self.pending(id, None, from).await {
                Ok(page) => {
                    end = (page.len() as u64) < self.settings.batch;
                    rows.extend(page);
                    if end {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(shard = %name, error = %e.report(), "outbox not read; next pass");
                    report.shards_failed = 1;
                    // Read again from where it was.
                    return Pass {
                        report,
                        top: window.is_none(),
                        end: true,
                    };
                }
            }
        }
        let next = match (end, rows.first(), rows.last()) {
            (false, Some(first), Some(last)) => {
                let last_key = (&last.grp, &last.key_text);
                Some(Window {
                    // Past the last key when it alone filled the pass, or
                    // when this pass began at it already (keys the database
                    // compares as equal, `'k'` and `'k '` under MySQL's
                    // padding, would otherwise hold the window there).
                    inclusive: (&first.grp, &first.key_text) != last_key
                        && window
                            .as_ref()
                            .is_none_or(|w| (&w.grp, &w.key_text) != last_key),
                    grp: last.grp.clone(),
                    key_text: last.key_text.clone(),
                })
            }
            _ => None,
        };
        {
            let mut windows = self.lock_windows();
            match next {
                Some(next) => {
                    // Handles made per request leave windows behind: keep
                    // a bounded number, this handle's first.
                    if windows.len() >= 256 {
                        windows.retain(|(set, _), _| *set == self.handlers);
                    }
                    windows.insert((self.handlers, id.0), next);
                }
                None => {
                    windows.remove(&(self.handlers, id.0));
                }
            }
        }
        let top = window.is_none();
        // One sending key's messages alone filled the pass: its messages to
        // other receivers than the ones read may wait after them; read the
        // first ones of each of its pairs the pages did not reach (a failed
        // read leaves them to the next visit).
        let mut heads = Vec::new();
        let mut pair_read = None;
        if let (false, Some(first), Some(last)) = (end, rows.first(), rows.last())
            && (&first.grp, &first.key_text) == (&last.grp, &last.key_text)
        {
            let read = (
                self.handlers,
                id.0,
                first.grp.clone(),
                first.key_text.clone(),
            );
            if !running || self.pair_read_due(&read) {
                match self.pair_heads(id, last).await {
                    Ok(found) => heads = found,
                    Err(e) => {
                        tracing::warn!(shard = %name, error = %e.report(), "a sending key's pairs past its first messages not read; next visit")
                    }
                }
                pair_read = running.then_some(read);
            }
        }
        // The messages of one sending key to one receiving key, in order,
        // up to the first one this relay cannot apply (a type it has no
        // handler for: another relay's, which goes first).
        let mut pairs: Vec<Vec<(Row, Arc<dyn Kind>)>> = Vec::new();
        let mut blocked: Vec<bool> = Vec::new();
        let mut at: HashMap<(String, String, String, String), usize> = HashMap::new();
        let read = rows.len();
        // Pairs `..from_pages` are the ones the pages read.
        let mut from_pages = 0;
        for (n, row) in rows.into_iter().chain(heads).enumerate() {
            let pair = (
                row.grp.clone(),
                row.key_text.clone(),
                row.to_grp.clone(),
                row.to_key.clone(),
            );
            let i = match at.get(&pair) {
                // A pair the pages read has its messages from there.
                Some(&i) if n >= read && i < from_pages => continue,
                Some(&i) => i,
                None => {
                    at.insert(pair, pairs.len());
                    pairs.push(Vec::new());
                    blocked.push(false);
                    pairs.len() - 1
                }
            };
            if n < read {
                from_pages = pairs.len();
            }
            if blocked[i] {
                continue;
            }
            match self.kinds.get(row.kind.as_str()) {
                // The map read once per pair: a move's flip between two of
                // its rows must not let a later one go alone.
                Some(kind)
                    if kind.has_handler()
                        && (!pairs[i].is_empty() || kind.owned_by(&self.cluster, &row, &name)) =>
                {
                    pairs[i].push((row, Arc::clone(kind)));
                }
                Some(_) => blocked[i] = true,
                None => {
                    blocked[i] = true;
                    self.warn_unknown(&row);
                }
            }
        }
        let pairs: Vec<BoxFuture<'_, RelayReport>> = pairs
            .into_iter()
            .filter(|pair| !pair.is_empty())
            .map(|pair| self.bounded_pair(pair))
            .collect();
        let mut done = futures::stream::iter(pairs).buffer_unordered(self.settings.parallel);
        while let Some(r) = done.next().await {
            report.add(r);
        }
        if let Some(read) = pair_read {
            let mut reads = self.lock_pair_reads();
            if report.progressed() {
                reads.remove(&read);
            } else {
                let now = self.cluster.shards().now_ms();
                reads.retain(|_, at| now - *at < 60 * PAIR_READ_EVERY);
                reads.insert(read, now);
            }
        }
        Pass { report, top, end }
    }

    /// Whether a read of a sending key's pairs may run now: not within
    /// [`PAIR_READ_EVERY`] of one that applied nothing (a clock that went
    /// back does not hold it off).
    fn pair_read_due(&self, read: &PairRead) -> bool {
        let now = self.cluster.shards().now_ms();
        self.lock_pair_reads()
            .get(read)
            .is_none_or(|&at| now < at || now - at >= PAIR_READ_EVERY)
    }

    /// Warns, once per type and handle, that a pair waits on a message of a
    /// type this relay does not know: applied by another relay, or by none
    /// (a release rolled back past the type).
    fn warn_unknown(&self, row: &Row) {
        let mut unknown = self.unknown.lock().unwrap_or_else(|e| e.into_inner());
        if unknown.len() < 64 && unknown.insert(row.kind.clone()) {
            tracing::warn!(
                message = %row.id,
                kind = %row.kind,
                from = %format_args!("{} {}", row.grp, row.key_text),
                to = %format_args!("{} {}", row.to_grp, row.to_key),
                "a pair waits on a message of a type this relay does not know: the pair's later \
                 messages go once a relay that handles it has applied it"
            );
        }
    }

    fn lock_pair_reads(&self) -> std::sync::MutexGuard<'_, HashMap<PairRead, i64>> {
        self.pair_reads.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_windows(&self) -> std::sync::MutexGuard<'_, HashMap<(u64, u32), Window>> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`deliver_pair`](Self::deliver_pair): its applies bounded by the
    /// step timeout (one that runs out is put off by the backoff, see
    /// below), the whole pair by twice that (the sender's row changes are
    /// bounded too).
    fn bounded_pair(&self, pair: Vec<(Row, Arc<dyn Kind>)>) -> BoxFuture<'_, RelayReport> {
        let step = self.settings.step_timeout;
        Box::pin(async move {
            let applies_by = tokio::time::Instant::now() + step;
            tokio::time::timeout(step.saturating_mul(2), self.deliver_pair(pair, applies_by))
                .await
                .unwrap_or(RelayReport {
                    deferred: 1,
                    ..RelayReport::default()
                })
        })
    }

    /// Applies a pair's messages in order, stopping at the first that
    /// cannot be applied now.
    async fn deliver_pair(
        &self,
        pair: Vec<(Row, Arc<dyn Kind>)>,
        applies_by: tokio::time::Instant,
    ) -> RelayReport {
        let mut report = RelayReport::default();
        let shards = self.cluster.shards();
        for (row, kind) in pair {
            let now = shards.now_ms();
            if row.next_at > now {
                break;
            }
            // Whether an attempt of it may have been applied longer than
            // the inbox keeps ids ago (applied, then the relay stopped
            // before the sender's row changed): when it was last tried, at
            // the earliest (a failed or put-off attempt sets `next_at` at
            // most the longest backoff after it), else when it was sent. A
            // message an operator retried (no attempt, an error kept, no
            // wait) is applied anyway.
            let retried = row.attempts == 0 && row.last_error.is_some() && row.next_at == 0;
            let tried_since = if row.next_at > 0 {
                row.next_at - self.settings.max_backoff.as_millis() as i64
            } else {
                row.created_at
            };
            let expired = !retried && now - tried_since > INBOX_TTL.as_millis() as i64;
            let delivery = if expired {
                Delivery::Undecodable(format!(
                    "sent or last tried more than {} days ago: the receiving inbox may no longer \
                     hold its id, so applying it could apply it twice; `retry` applies it anyway",
                    INBOX_TTL.as_secs() / 86_400
                ))
            } else {
                // An apply cut off by the step timeout (its transaction
                // rolled back) is put off by the backoff like a shard that
                // did not answer, not tried again at the next pass: a slow
                // handler would otherwise run back to back, holding the
                // receiving key's rows (on SQLite, its file's write lock).
                tokio::time::timeout_at(applies_by, kind.deliver(&self.cluster, &row))
                    .await
                    .unwrap_or_else(|_| {
                        Delivery::Unavailable(format!(
                            "not applied within the step timeout ({:?}): the handler or the receiving shard is slow",
                            self.settings.step_timeout
                        ))
                    })
            };
            let mut step = RelayReport::default();
            let change = match delivery {
                Delivery::Applied => {
                    let lag = Ord::max(shards.now_ms() - row.created_at, 0);
                    crate::metrics::outbox_delivered(
                        kind.name(),
                        Duration::from_millis(lag as u64),
                    );
                    step.applied = 1;
                    SourceChange::Delivered
                }
                Delivery::Duplicate => {
                    step.duplicates = 1;
                    SourceChange::Delivered
                }
                Delivery::Unavailable(error) | Delivery::Aborted(error) => {
                    step.deferred = 1;
                    let times = {
                        let mut put_off = self.put_off.lock().unwrap_or_else(|e| e.into_inner());
                        if put_off.len() >= PUT_OFF_COUNTED {
                            put_off.clear();
                        }
                        let times = put_off.entry(row.id.clone()).or_default();
                        *times = times.saturating_add(1);
                        *times
                    };
                    tracing::debug!(message = %row.id, kind = %row.kind, times, %error, "delivery put off");
                    SourceChange::Failed {
                        next_at: now + self.wait_after(Ord::max(row.attempts, times)),
                        attempts: row.attempts,
                        error,
                        parked: false,
                    }
                }
                Delivery::Failed(error) => {
                    let attempts = row.attempts.saturating_add(1);
                    let parked = attempts >= self.settings.max_attempts;
                    crate::metrics::outbox_failed(kind.name(), parked);
                    step.failed = 1;
                    step.parked = u64::from(parked);
                    tracing::warn!(message = %row.id, kind = %row.kind, attempts, parked, %error, "message handler failed");
                    SourceChange::Failed {
                        next_at: now + self.wait_after(attempts),
                        attempts,
                        error,
                        parked,
                    }
                }
                Delivery::Undecodable(error) => {
                    crate::metrics::outbox_failed(kind.name(), true);
                    step.parked = 1;
                    tracing::warn!(message = %row.id, kind = %row.kind, %error, "message parked: it cannot be applied");
                    SourceChange::Failed {
                        next_at: now,
                        attempts: row.attempts.saturating_add(1),
                        error,
                        parked: true,
                    }
                }
            };
            if step.deferred == 0 {
                self.put_off
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&row.id);
            }
            let delivered = matches!(change, SourceChange::Delivered);
            // The relay dying here (after the apply, before the message is
            // deleted) leaves it to be delivered again: the inbox holds it.
            if shards.failpoint("shardkit::outbox::after_apply").is_some() {
                return report;
            }
            // Counted once the sender's row shows it: a pass whose changes
            // all fail made no progress (and is not run again at once).
            if let Err(e) = kind.change(&self.cluster, &row, change).await {
                tracing::debug!(message = %row.id, error = %e.report(), "outbox row not updated; next pass");
                break;
            }
            report.add(step);
            if !delivered {
                break;
            }
        }
        report
    }

    fn wait_after(&self, attempts: i32) -> i64 {
        let doubled = self
            .settings
            .first_backoff
            .saturating_mul(1u32 << (attempts - 1).clamp(0, 20) as u32);
        doubled.min(self.settings.max_backoff).as_millis() as i64
    }

    /// Shard `id`'s outbox rows, oldest first within each key: pending
    /// ones, or with `state`, those in that state.
    async fn pending(
        &self,
        id: ShardId,
        state: Option<&str>,
        from: Option<Start<'_>>,
    ) -> Result<Vec<Row>> {
        let mut stmt = self.rows_in(state);
        match from {
            Some(Start::After(after)) => {
                let columns = ["grp", "key_text", "seq", "id"]
                    .map(|c| SimpleExpr::from(Expr::col(Alias::new(c))));
                let values: [SimpleExpr; 4] = [
                    Expr::val(after.grp.as_str()),
                    Expr::val(after.key_text.as_str()),
                    Expr::val(after.seq),
                    Expr::val(after.id.as_str()),
                ];
                stmt.and_where(Expr::tuple(columns).gt(Expr::tuple(values)));
            }
            Some(Start::Window(window)) => {
                let columns =
                    ["grp", "key_text"].map(|c| SimpleExpr::from(Expr::col(Alias::new(c))));
                let values: [SimpleExpr; 2] = [
                    Expr::val(window.grp.as_str()),
                    Expr::val(window.key_text.as_str()),
                ];
                let (columns, values) = (Expr::tuple(columns), Expr::tuple(values));
                stmt.and_where(if window.inclusive {
                    columns.gte(values)
                } else {
                    columns.gt(values)
                });
            }
            None => {}
        }
        let stmt = stmt
            .order_by(Alias::new("grp"), Order::Asc)
            .order_by(Alias::new("key_text"), Order::Asc)
            .order_by(Alias::new("seq"), Order::Asc)
            .order_by(Alias::new("id"), Order::Asc)
            .limit(if state.is_some() {
                100
            } else {
                self.settings.batch
            })
            .to_owned();
        self.rows(id, &stmt).await
    }

    /// The first messages of the pairs of `last`'s sending key that begin
    /// after `last`, the last of that key's messages the pages read (the
    /// pairs the pages did not reach): every such pair's first message,
    /// then each one's second, and so on, `batch` at most. Read when that
    /// key's messages alone filled a pass: those were its first ones, maybe
    /// all of one pair that waits (its first message put off), and its
    /// messages to other receivers come after them. Each pair's messages
    /// here begin at its first, so they still go in order. The pairs are
    /// told apart by length too: MySQL's padding compares `'k'` and `'k '`
    /// as one receiving key.
    async fn pair_heads(&self, id: ShardId, last: &Row) -> Result<Vec<Row>> {
        let col = |name: &str| Expr::col(Alias::new(name));
        let length = |e: Expr| -> Expr { Func::cust("LENGTH").arg(e).into() };
        let handled: Vec<&str> = self
            .kinds
            .iter()
            .filter(|(_, k)| k.has_handler())
            .map(|(name, _)| *name)
            .collect();
        let mut pair = WindowStatement::new();
        pair.partition_by(Alias::new("to_grp"))
            .partition_by(Alias::new("to_key"))
            .add_partition_by(length(col("to_key")))
            .order_by(Alias::new("seq"), Order::Asc)
            .order_by(Alias::new("id"), Order::Asc);
        let mut inner = self.rows_in(None);
        inner
            .and_where(col("grp").eq(last.grp.as_str()))
            .and_where(col("key_text").eq(last.key_text.as_str()))
            .and_where(length(col("key_text")).eq(length(Expr::val(last.key_text.as_str()))));
        let first = |column: &str| Func::cust("FIRST_VALUE").arg(col(column));
        for (value, name) in [
            (first("kind"), "head_kind"),
            (first("next_at"), "head_next_at"),
            (first("seq"), "head_seq"),
            (first("id"), "head_id"),
            (Func::cust("ROW_NUMBER"), "pair_rank"),
        ] {
            inner.expr_window_as(value, pair.clone(), Alias::new(name));
        }
        let stmt = Query::select()
            .columns(OUTBOX.names())
            .from_subquery(inner, Alias::new("pending_pairs"))
            .and_where(
                Expr::tuple([col("head_seq"), col("head_id")]).gt(Expr::tuple([
                    Expr::val(last.seq),
                    Expr::val(last.id.as_str()),
                ])),
            )
            // Pairs that can go now: a first message this relay applies,
            // not put off.
            .and_where(col("head_kind").is_in(handled))
            .and_where(col("head_next_at").lte(self.cluster.shards().now_ms()))
            .order_by(Alias::new("pair_rank"), Order::Asc)
            .order_by(Alias::new("to_grp"), Order::Asc)
            .order_by(Alias::new("to_key"), Order::Asc)
            .order_by(Alias::new("seq"), Order::Asc)
            .order_by(Alias::new("id"), Order::Asc)
            .limit(self.settings.batch)
            .to_owned();
        self.rows(id, &stmt).await
    }

    /// The outbox's rows in `state` (pending ones by default), of every
    /// type: one this relay has no handler for still holds up the later
    /// messages of its pair.
    fn rows_in(&self, state: Option<&str>) -> sea_orm::sea_query::SelectStatement {
        let mut stmt = Query::select();
        stmt.columns(OUTBOX.names())
            .from(Alias::new(OUTBOX.name))
            .and_where(Expr::col(Alias::new("state")).eq(state.unwrap_or("pending")));
        stmt
    }

    /// The outbox rows `stmt` reads on shard `id`.
    async fn rows(
        &self,
        id: ShardId,
        stmt: &sea_orm::sea_query::SelectStatement,
    ) -> Result<Vec<Row>> {
        let name = self.cluster.shards().shard_name(id);
        self.query(id, stmt, "read")
            .await?
            .iter()
            .map(|r| Row::read(r, id).map_err(|e| db_err(name, OUTBOX.name, "read", e)))
            .collect()
    }

    /// `stmt` on shard `id`'s side pool, under its breaker and the step
    /// timeout.
    async fn query(
        &self,
        id: ShardId,
        stmt: &sea_orm::sea_query::SelectStatement,
        what: &str,
    ) -> Result<Vec<sea_orm::QueryResult>> {
        let shards = self.cluster.shards();
        let name = shards.shard_name(id);
        let db = shards.side_conn(id);
        shards
            .bounded(id, "outbox", Some(self.settings.step_timeout), async {
                db.query_all(stmt)
                    .await
                    .map_err(|e| db_err(name, OUTBOX.name, what, e))
            })
            .await
    }

    /// Shard `id`'s count of messages in each state, and the oldest
    /// pending one's send time.
    async fn counts(&self, id: ShardId) -> Result<(u64, u64, Option<i64>)> {
        let shards = self.cluster.shards();
        let name = shards.shard_name(id);
        let stmt = Query::select()
            .column(Alias::new("state"))
            .expr_as(Expr::col(Alias::new("id")).count(), Alias::new("n"))
            .expr_as(
                Expr::col(Alias::new("created_at")).min(),
                Alias::new("oldest"),
            )
            .from(Alias::new(OUTBOX.name))
            .group_by_col(Alias::new("state"))
            .to_owned();
        let rows = self.query(id, &stmt, "count").await?;
        {
            let (mut pending, mut parked, mut oldest) = (0, 0, None);
            for r in rows {
                let state: String = r
                    .try_get("", "state")
                    .map_err(|e| db_err(name, OUTBOX.name, "count", e))?;
                let n: i64 = r
                    .try_get("", "n")
                    .map_err(|e| db_err(name, OUTBOX.name, "count", e))?;
                match state.as_str() {
                    "pending" => {
                        pending = n as u64;
                        oldest = r.try_get::<Option<i64>>("", "oldest").ok().flatten();
                    }
                    _ => parked += n as u64,
                }
            }
            Ok((pending, parked, oldest))
        }
    }

    /// Whether shard `id`'s periodic work `slot` (see
    /// [`housekeeping`](Self::housekeeping)) last ran `every` ms ago or
    /// more; if so, it runs now.
    fn due(&self, id: ShardId, slot: usize, every: i64) -> bool {
        let now = self.cluster.shards().now_ms();
        let mut last = self
            .housekeeping
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = &mut last.entry(id.0).or_insert([0; 2])[slot];
        let due = now < *at || now - *at >= every;
        if due {
            *at = now;
        }
        due
    }

    /// About once a second, sets shard `id`'s pending and parked gauges;
    /// about once a minute, deletes its inbox ids and finished sagas older
    /// than [`INBOX_TTL`] and its request outcomes older than
    /// [`REQUEST_TTL`](crate::outbox::REQUEST_TTL).
    async fn housekeeping(&self, id: ShardId) {
        let shards = self.cluster.shards();
        let now = shards.now_ms();
        let (count, prune) = (self.due(id, 0, 1_000), self.due(id, 1, 60_000));
        if count && let Ok((pending, parked, _)) = self.counts(id).await {
            crate::metrics::outbox_counts(shards.shard_name(id), pending, parked);
        }
        if prune {
            let name = shards.shard_name(id);
            let db = shards.side_conn(id);
            let pruned = shards
                .bounded(id, "outbox", Some(self.settings.step_timeout), async {
                    // Each keyed table's rows that go by age (saga markers
                    // and unfinished sagas stay; see `Expiry`).
                    for table in crate::exec::keyed_tables::ALL {
                        let Some(expired) = table.expired_where(now) else {
                            continue;
                        };
                        let delete = Query::delete()
                            .from_table(Alias::new(table.name))
                            .cond_where(expired)
                            .to_owned();
                        db.execute(&delete)
                            .await
                            .map_err(|e| db_err(name, table.name, "delete from", e))?;
                    }
                    Ok(())
                })
                .await;
            if let Err(e) = pruned {
                tracing::debug!(shard = %name, error = %e.report(), "old inbox ids and outcomes not pruned; later");
            }
        }
    }

    /// Every shard's outbox: pending and parked messages (a shard that
    /// cannot be read is listed with its error).
    pub async fn status(&self) -> Result<OutboxStatus> {
        let shards = self.cluster.shards();
        let mut out = Vec::new();
        for i in 0..shards.topology().shards().len() as u32 {
            let id = ShardId(i);
            let shard = shards.shard_name(id).to_owned();
            let read = async {
                let (pending, parked_count, oldest) = self.counts(id).await?;
                let parked = self.pending(id, Some("parked"), None).await?;
                Ok::<_, ShardError>((pending, parked_count, oldest, parked))
            };
            out.push(match read.await {
                Ok((pending, parked_count, oldest_pending_ms, parked)) => ShardOutbox {
                    shard,
                    pending,
                    oldest_pending_ms,
                    parked_count,
                    parked: parked
                        .into_iter()
                        .map(|r| ParkedMessage {
                            id: r.id,
                            kind: r.kind,
                            from: (r.grp, r.key_text),
                            to: (r.to_grp, r.to_key),
                            attempts: r.attempts,
                            last_error: r.last_error,
                        })
                        .collect(),
                    error: None,
                },
                Err(e) => ShardOutbox {
                    shard,
                    pending: 0,
                    oldest_pending_ms: None,
                    parked: Vec::new(),
                    parked_count: 0,
                    error: Some(e.report().to_string()),
                },
            });
        }
        Ok(OutboxStatus { shards: out })
    }

    /// Makes parked message `id` pending again, its attempts reset.
    pub async fn retry(&self, id: &str) -> Result<()> {
        self.operate(id, SourceChange::Retry).await
    }

    /// Deletes parked message `id` without applying it.
    pub async fn discard(&self, id: &str) -> Result<()> {
        self.operate(id, SourceChange::Discard).await
    }

    fn operate<'a>(&'a self, id: &'a str, change: SourceChange) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let what = || format!("message {id}");
            let row = self.find(id).await?.ok_or_else(|| ShardError::CrossKey {
                what: what(),
                reason: "no shard's outbox holds it".to_owned(),
            })?;
            if row.state != "parked" {
                return Err(ShardError::CrossKey {
                    what: row.what(),
                    reason: format!(
                        "it is {}, not parked: only a parked message is retried or discarded",
                        row.state
                    ),
                });
            }
            let kind = self.kinds.get(row.kind.as_str()).ok_or_else(|| ShardError::CrossKey {
                what: row.what(),
                reason: "its message type is not registered here: add it with `.message::<M>()` or `.handle::<M, _, _, _>(..)`".to_owned(),
            })?;
            if kind.change(&self.cluster, &row, change).await? {
                Ok(())
            } else {
                Err(ShardError::CrossKey {
                    what: row.what(),
                    reason:
                        "it changed meanwhile (applied, retried or discarded by another process)"
                            .to_owned(),
                })
            }
        })
    }

    /// Message `id` on the shard that owns its sender's key. Every shard
    /// is read at once; one that cannot be read fails the search only when
    /// no other holds the message (it may be the one that does), so an
    /// operator clears a parked message while another shard is down.
    async fn find(&self, id: &str) -> Result<Option<Row>> {
        let shards = self.cluster.shards();
        let stmt = Query::select()
            .columns(OUTBOX.names())
            .from(Alias::new(OUTBOX.name))
            .and_where(Expr::col(Alias::new("id")).eq(id))
            .to_owned();
        let count = shards.topology().shards().len() as u32;
        let stmt = &stmt;
        let reads = futures::future::join_all(
            (0..count).map(|i| async move { (i, self.query(ShardId(i), stmt, "read").await) }),
        )
        .await;
        let (mut found, mut failed) = (None, None);
        for (i, read) in reads {
            let name = shards.shard_name(ShardId(i));
            let rows = match read {
                Ok(rows) => rows,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            for r in rows {
                let row =
                    Row::read(&r, ShardId(i)).map_err(|e| db_err(name, OUTBOX.name, "read", e))?;
                let owned = self
                    .kinds
                    .get(row.kind.as_str())
                    .is_none_or(|k| k.owned_by(&self.cluster, &row, name));
                if owned {
                    found = Some(row);
                }
            }
        }
        match (found, failed) {
            (None, Some(e)) => Err(e),
            (found, _) => Ok(found),
        }
    }
}
