//! Per-shard circuit breakers.
//!
//! A pool asked for a connection to a server that refuses or never answers
//! retries until its acquire timeout (30 s by default) and then reports only
//! "pool timed out". shardkit instead watches every request that waits on a
//! PostgreSQL or MySQL shard ([`crate::exec::watchdog`]; SQLite's files are
//! opened in-process): one still waiting after [`SUSPECT_AFTER`] starts a
//! probe (one connection opened directly, bounded by the connect timeout),
//! or takes the outcome of one that ended less than [`HEALTHY_FOR`] ago. One probe
//! runs at a time per shard, shared by everyone who asks. A failed probe
//! marks the shard down with the driver's own cause ("connection refused",
//! "no answer within 1 s"): the waiting requests fail with
//! [`ShardError::Unavailable`](crate::ShardError::Unavailable).
//!
//! While the shard is down its breaker is half-open: a request that needs
//! the shard starts the next probe itself (when the last one ended long
//! enough ago: [`PROBE_GAP`], growing to a quarter of the outage, at most
//! [`REPROBE`], on the cluster's clock) and waits on it; requests arriving
//! while it runs wait on the same probe, each until [`HALF_OPEN_WAIT`]
//! after the probe started. A probe that finds the shard up closes the
//! breaker and the requests waiting on it go on; otherwise they fail with
//! the cause, and so does every other request, at once and without I/O. So
//! a shard back from a short cut serves the first request that needs it,
//! and a shard that refuses or hangs costs one probe per gap, never a wait
//! of the connect timeout per request. A background probe (every
//! [`REPROBE`] when due, stopped when the cluster is dropped) brings back a
//! shard no request needs.
//!
//! A server at its connection limit (PostgreSQL's "too many clients",
//! MySQL/MariaDB's "Too many connections") answered: neither a request
//! failing with that nor a probe refused with it marks the shard down
//! ([`suspects_down`], [`ProbeFailure::Full`]); the request fails with the
//! database's error, which is [`Retry::After`](crate::Retry::After) a short
//! wait.

use crate::clock::Clock;
use crate::error::{ShardError, SqlxCause, is_capacity, sqlx_is_capacity};
use crate::exec::watchdog::Watchdog;
use crate::topology::DatabaseUrl;
use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a request waits on a shard before its health is checked.
pub(crate) const SUSPECT_AFTER: Duration = Duration::from_millis(150);

pub(crate) use crate::error::REPROBE;

/// How long a successful probe vouches for a shard.
pub(crate) const HEALTHY_FOR: Duration = Duration::from_secs(1);

/// How long, from a probe's start, requests of a down shard wait on its
/// result (half-open); later ones fail at once.
pub(crate) const HALF_OPEN_WAIT: Duration = SUSPECT_AFTER;

/// The least time between the end of a failed probe and the next probe of a
/// down shard. The gap grows with the outage: a quarter of the time the
/// shard has been down, between this and [`REPROBE`].
pub(crate) const PROBE_GAP: Duration = Duration::from_millis(50);

/// A probe's outcome: the cause (password scrubbed) when the shard is down.
pub(crate) type ProbeResult = std::result::Result<(), String>;

/// The result of the one probe running, for every request that waits on it.
pub(crate) type SharedProbe = Shared<BoxFuture<'static, ProbeResult>>;

/// How one shard is probed.
enum Probe {
    Postgres(sea_orm::sqlx::postgres::PgConnectOptions),
    MySql(sea_orm::sqlx::mysql::MySqlConnectOptions),
    /// SQLite files are opened in-process: nothing to probe.
    None,
}

/// One shard's breaker.
pub(crate) struct ShardHealth {
    probe: Probe,
    timeout: Duration,
    url: DatabaseUrl,
    state: Mutex<State>,
    /// Whether a background probe task runs for this shard.
    reprobing: AtomicBool,
    /// The requests waiting on the shard, for the breaker's watch.
    waiting: Watchdog,
}

/// A breaker's state. Only a probe's end changes whether the shard is down,
/// and one probe runs at a time, so outcomes apply in the order they end.
#[derive(Default)]
struct State {
    /// Why the shard is down and since when (the cluster clock's ms).
    down: Option<(String, u64)>,
    /// The last probe: when it ended (real time, and the clock's ms), and
    /// its outcome.
    last: Option<(Instant, u64, ProbeResult)>,
    /// The probe running.
    running: Option<Running>,
    /// Probes started so far: the running one's number.
    probes: u64,
    /// The clock the breaker was last asked with (for [`ShardHealth::check`]).
    clock: Option<Arc<dyn Clock>>,
}

/// The probe running on a shard.
struct Running {
    started: tokio::time::Instant,
    probe: SharedProbe,
    /// Its number ([`State::probes`]): its end clears this probe only.
    generation: u64,
}

/// A probe recorded as running, not yet spawned ([`ShardHealth::record`]).
#[must_use = "a probe recorded as running must be spawned"]
struct Launch(Finish);

impl Launch {
    /// Runs the probe in a task of its own (a request that gives up must
    /// not cancel the probe that would mark the shard down or up). Never
    /// called with the breaker's state locked.
    fn spawn(self) {
        let Launch(mut finish) = self;
        tokio::spawn(async move {
            finish.result = Some(finish.health.probe_once().await);
            drop(finish);
        });
    }
}

/// Ends a probe however its task ends (done, or dropped by a runtime that
/// shut down, before it ran or while it ran): applies its outcome, if it
/// has one, and tells the requests waiting on it.
struct Finish {
    health: Arc<ShardHealth>,
    clock: Arc<dyn Clock>,
    generation: u64,
    result: Option<ProbeResult>,
    sender: Option<tokio::sync::oneshot::Sender<ProbeResult>>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        let now = self.clock.now_millis();
        let result = self.result.take();
        {
            let mut state = self.health.state();
            if state
                .running
                .as_ref()
                .is_some_and(|r| r.generation == self.generation)
            {
                state.running = None;
            }
            if let Some(result) = &result {
                match result {
                    Ok(()) => state.down = None,
                    Err(cause) => {
                        let since = state.down.as_ref().map_or(now, |(_, since)| *since);
                        state.down = Some((cause.clone(), since));
                    }
                }
                state.last = Some((Instant::now(), now, result.clone()));
            }
        }
        // After the state: a request woken by the outcome finds it applied.
        if let (Some(sender), Some(result)) = (self.sender.take(), result) {
            let _ = sender.send(result);
        }
    }
}

/// What a request of a shard does, by its breaker ([`ShardHealth::gate`]).
pub(crate) enum Gate {
    /// The shard is up: go on.
    Closed,
    /// The shard is down: fail at once with the cause.
    Open(String),
    /// The shard is down and a probe runs: wait on its result until
    /// `until`, go on if it finds the shard up.
    HalfOpen {
        until: tokio::time::Instant,
        probe: SharedProbe,
    },
}

impl ShardHealth {
    /// Whether the shard can be probed at all (a probe connection exists
    /// for its backend).
    pub(crate) fn can_probe(&self) -> bool {
        !matches!(self.probe, Probe::None)
    }

    /// The breaker of a shard at `url`; probes wait at most `timeout`.
    pub(crate) fn new(url: &DatabaseUrl, timeout: Duration) -> Self {
        use std::str::FromStr;
        let (driver_url, password) = url.for_driver();
        let probe = if driver_url.starts_with("postgres") {
            match sea_orm::sqlx::postgres::PgConnectOptions::from_str(&driver_url) {
                Ok(opts) => Probe::Postgres(match &password {
                    Some(p) => opts.password(p),
                    None => opts,
                }),
                Err(_) => Probe::None,
            }
        } else if driver_url.starts_with("mysql") || driver_url.starts_with("mariadb") {
            match sea_orm::sqlx::mysql::MySqlConnectOptions::from_str(&driver_url) {
                Ok(opts) => Probe::MySql(match &password {
                    Some(p) => opts.password(p),
                    None => opts,
                }),
                Err(_) => Probe::None,
            }
        } else {
            Probe::None
        };
        ShardHealth {
            probe,
            timeout,
            url: url.clone(),
            state: Mutex::new(State::default()),
            reprobing: AtomicBool::new(false),
            waiting: Watchdog::default(),
        }
    }

    /// The requests waiting on the shard.
    pub(crate) fn waiting(&self) -> &Watchdog {
        &self.waiting
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the shard is down, if it is.
    pub(crate) fn down_cause(&self) -> Option<String> {
        self.state().down.as_ref().map(|(cause, _)| cause.clone())
    }

    /// What a request of the shard does now. Up: it goes on. Down: it waits
    /// on the running probe if that started less than [`HALF_OPEN_WAIT`]
    /// ago, else starts one if the last ended long enough ago (see
    /// [`PROBE_GAP`]) and waits on it, else fails at once.
    pub(crate) fn gate(self: &Arc<Self>, clock: &Arc<dyn Clock>) -> Gate {
        let mut state = self.state();
        remember(&mut state, clock);
        let Some((cause, _)) = &state.down else {
            return Gate::Closed;
        };
        let cause = cause.clone();
        if let Some(running) = &state.running {
            let until = running.started + HALF_OPEN_WAIT;
            return if tokio::time::Instant::now() < until {
                Gate::HalfOpen {
                    until,
                    probe: running.probe.clone(),
                }
            } else {
                Gate::Open(cause)
            };
        }
        if !due(&state, clock.now_millis()) {
            return Gate::Open(cause);
        }
        let probe = self.start(state, clock);
        Gate::HalfOpen {
            until: tokio::time::Instant::now() + HALF_OPEN_WAIT,
            probe,
        }
    }

    /// The running probe, or a new one if the shard is down and the last
    /// probe ended long enough ago; `None` otherwise (the background probe).
    pub(crate) fn probe_if_due(self: &Arc<Self>, clock: &Arc<dyn Clock>) -> Option<SharedProbe> {
        let state = self.state();
        if let Some(running) = &state.running {
            return Some(running.probe.clone());
        }
        if state.down.is_none() || !due(&state, clock.now_millis()) {
            return None;
        }
        Some(self.start(state, clock))
    }

    /// Starts a new probe: records it as the one running, unlocks `state`,
    /// then spawns its task. A runtime that is shutting down drops a task
    /// spawned on it there and then, and the task's end locks `state`.
    fn start(
        self: &Arc<Self>,
        mut state: MutexGuard<'_, State>,
        clock: &Arc<dyn Clock>,
    ) -> SharedProbe {
        let (probe, launch) = self.record(&mut state, clock);
        drop(state);
        launch.spawn();
        probe
    }

    /// Records a new probe as the one running and returns it, with the
    /// task that runs it, not yet spawned ([`start`](Self::start)).
    fn record(
        self: &Arc<Self>,
        state: &mut State,
        clock: &Arc<dyn Clock>,
    ) -> (SharedProbe, Launch) {
        state.probes += 1;
        let generation = state.probes;
        let (sender, outcome) = tokio::sync::oneshot::channel();
        // A probe whose task ended without an outcome (its runtime shut
        // down, before it ran or while it ran) found nothing.
        let probe = async move { outcome.await.unwrap_or(Ok(())) }
            .boxed()
            .shared();
        state.running = Some(Running {
            started: tokio::time::Instant::now(),
            probe: probe.clone(),
            generation,
        });
        let finish = Finish {
            health: Arc::clone(self),
            clock: Arc::clone(clock),
            generation,
            result: None,
            sender: Some(sender),
        };
        (probe, Launch(finish))
    }

    /// Claims the background probe of this down shard: `true` if none ran.
    pub(crate) fn start_reprobing(&self) -> bool {
        !self.reprobing.swap(true, Ordering::AcqRel)
    }

    /// The background probe stops.
    pub(crate) fn stop_reprobing(&self) {
        self.reprobing.store(false, Ordering::Release);
    }

    /// The breaker's probe: opens one connection and closes it; the cause
    /// (password scrubbed) when that fails or takes longer than the
    /// timeout. A server that refuses the connection for having too many
    /// ([`ProbeFailure::Full`]) answered: it is up.
    pub(crate) async fn probe_once(&self) -> ProbeResult {
        match self.connect_once().await {
            Ok(()) | Err(ProbeFailure::Full(_)) => Ok(()),
            Err(ProbeFailure::Down(cause)) => Err(cause),
        }
    }

    /// Opens one connection and closes it, saying why when that fails or
    /// takes longer than the timeout (the cause's password scrubbed).
    pub(crate) async fn connect_once(&self) -> std::result::Result<(), ProbeFailure> {
        use sea_orm::sqlx::{ConnectOptions as _, Connection as _};
        let timeout = self.timeout;
        let result = match &self.probe {
            Probe::None => return Ok(()),
            Probe::Postgres(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => return Err(ProbeFailure::Down(no_answer(timeout))),
            },
            Probe::MySql(opts) => match tokio::time::timeout(timeout, opts.connect()).await {
                Ok(Ok(conn)) => {
                    let _ = tokio::time::timeout(timeout, conn.close()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => return Err(ProbeFailure::Down(no_answer(timeout))),
            },
        };
        result.map_err(|e| {
            let cause = self.url.scrub(&SqlxCause(&e).to_string());
            if sqlx_is_capacity(&e) {
                ProbeFailure::Full(cause)
            } else {
                ProbeFailure::Down(cause)
            }
        })
    }

    /// The shard's state as of a probe at most [`HEALTHY_FOR`] old (waiting
    /// on the running probe, or running one, when there is none); a failure
    /// marks it down, a success up. Times are read on the clock the breaker
    /// was last asked with (the system clock before that).
    pub(crate) async fn check(self: &Arc<Self>) -> ProbeResult {
        let clock = self
            .state()
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(crate::clock::SystemClock));
        self.check_on(&clock).await
    }

    /// [`check`](Self::check), on `clock`.
    pub(crate) async fn check_on(self: &Arc<Self>, clock: &Arc<dyn Clock>) -> ProbeResult {
        let probe = {
            let mut state = self.state();
            remember(&mut state, clock);
            if let Some(running) = &state.running {
                running.probe.clone()
            } else if let Some((at, _, result)) = &state.last
                && at.elapsed() < HEALTHY_FOR
            {
                return result.clone();
            } else {
                self.start(state, clock)
            }
        };
        probe.await
    }
}

/// Keeps `clock` as the one the breaker was last asked with (without
/// touching its count when it is the one kept already).
fn remember(state: &mut State, clock: &Arc<dyn Clock>) {
    if !state
        .clock
        .as_ref()
        .is_some_and(|kept| Arc::ptr_eq(kept, clock))
    {
        state.clock = Some(Arc::clone(clock));
    }
}

/// Whether a down shard may be probed again at `now` (the clock's ms): the
/// last probe ended at least a quarter of the outage ago, at least
/// [`PROBE_GAP`] and at most [`REPROBE`].
fn due(state: &State, now: u64) -> bool {
    let (Some((_, since)), Some((_, ended, _))) = (&state.down, &state.last) else {
        return true;
    };
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let gap = (now.saturating_sub(*since) / 4).clamp(millis(PROBE_GAP), millis(REPROBE));
    now.saturating_sub(*ended) >= gap
}

/// Why a probe's connection failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ProbeFailure {
    /// The server is down, hung or refuses this client: the shard is down.
    Down(String),
    /// The server answered that it has too many connections
    /// ([`crate::error::is_capacity`]): it is up, and accepts connections
    /// again as others close. The breaker does not open for it.
    Full(String),
}

impl ProbeFailure {
    /// The cause, password scrubbed.
    pub(crate) fn into_cause(self) -> String {
        match self {
            ProbeFailure::Down(cause) | ProbeFailure::Full(cause) => cause,
        }
    }
}

/// Whether a request's error makes the breaker suspect its shard is down
/// (and so probe it): the pool could not hand out a connection, or the
/// connection failed, except when the server refused it for having too
/// many connections. Statement errors, timeouts and capacity errors never
/// mark a shard down.
pub(crate) fn suspects_down(err: &ShardError) -> bool {
    match err {
        ShardError::Db { source, .. } => {
            matches!(
                source,
                sea_orm::DbErr::ConnectionAcquire(_) | sea_orm::DbErr::Conn(_)
            ) && !is_capacity(source)
        }
        _ => false,
    }
}

fn no_answer(timeout: Duration) -> String {
    format!(
        "the server accepted no connection within {} ms (connect timeout): it is down or hung",
        timeout.as_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on a free local port that answers every connection with
    /// `reply` (after reading the client's first message) and closes it.
    async fn refusing_server(pg: bool, reply: Vec<u8>) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let reply = reply.clone();
                tokio::spawn(async move {
                    if pg {
                        // SSLRequest (answered `N`), then the startup message.
                        loop {
                            let len = socket.read_u32().await.unwrap_or(0) as usize;
                            let mut body = vec![0; len.saturating_sub(4)];
                            if socket.read_exact(&mut body).await.is_err() {
                                return;
                            }
                            if body.get(..4) == Some(&80_877_103u32.to_be_bytes()[..]) {
                                let _ = socket.write_all(b"N").await;
                                continue;
                            }
                            break;
                        }
                    }
                    let _ = socket.write_all(&reply).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        port
    }

    /// PostgreSQL's refusal of a connection: an `ErrorResponse` with
    /// SQLSTATE 53300, as a server at `max_connections` sends it.
    fn pg_too_many_clients() -> Vec<u8> {
        let mut fields = Vec::new();
        for (tag, value) in [
            (b'S', "FATAL"),
            (b'V', "FATAL"),
            (b'C', "53300"),
            (b'M', "sorry, too many clients already"),
            (b'F', "proc.c"),
            (b'L', "359"),
            (b'R', "InitProcess"),
        ] {
            fields.push(tag);
            fields.extend_from_slice(value.as_bytes());
            fields.push(0);
        }
        fields.push(0);
        let mut message = vec![b'E'];
        message.extend_from_slice(&(fields.len() as u32 + 4).to_be_bytes());
        message.extend_from_slice(&fields);
        message
    }

    /// MySQL/MariaDB's refusal in place of its greeting: an ERR packet 1040.
    fn mysql_too_many_connections() -> Vec<u8> {
        let mut payload = vec![0xff];
        payload.extend_from_slice(&1040u16.to_le_bytes());
        payload.extend_from_slice(b"Too many connections");
        let mut packet = (payload.len() as u32).to_le_bytes()[..3].to_vec();
        packet.push(0);
        packet.extend_from_slice(&payload);
        packet
    }

    /// A probe refused for having too many connections finds the server up
    /// (the breaker stays closed); `connect_once` still says why, for
    /// `Cluster::connect`, with the password scrubbed.
    #[tokio::test]
    async fn a_server_at_its_connection_limit_is_not_down() {
        let pg = refusing_server(true, pg_too_many_clients()).await;
        let mysql = refusing_server(false, mysql_too_many_connections()).await;
        for (url, cause) in [
            (
                format!("postgres://app:hunter2@127.0.0.1:{pg}/shop"),
                "sorry, too many clients already (SQLSTATE 53300)",
            ),
            (
                format!("mysql://app:hunter2@127.0.0.1:{mysql}/shop"),
                "1040: Too many connections",
            ),
        ] {
            let health = ShardHealth::new(&DatabaseUrl::new(url.clone()), Duration::from_secs(5));
            assert_eq!(
                health.connect_once().await,
                Err(ProbeFailure::Full(cause.to_owned())),
                "{url}"
            );
            assert_eq!(health.probe_once().await, Ok(()), "{url}");
            let health = Arc::new(health);
            assert_eq!(health.check().await, Ok(()), "{url}");
            assert_eq!(health.down_cause(), None);
        }
    }

    /// The breaker of a shard whose port refuses connections.
    fn unreachable_shard() -> Arc<ShardHealth> {
        let url = DatabaseUrl::new("postgres://app:hunter2@127.0.0.1:1/shop".to_owned());
        Arc::new(ShardHealth::new(&url, Duration::from_secs(1)))
    }

    /// A probe started on a runtime that has shut down (a cluster used from
    /// a runtime that ended, a request polled while its runtime shuts down)
    /// ends, and says it found nothing: the task was dropped as it was
    /// spawned, while the breaker's state was locked to record the probe,
    /// and its end used to lock that state again and wait forever.
    #[test]
    fn a_probe_spawned_on_a_runtime_that_shut_down_ends() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        drop(runtime);
        let health = unreachable_shard();
        let (done, ended) = std::sync::mpsc::channel();
        let checked = Arc::clone(&health);
        std::thread::spawn(move || {
            let _runtime = handle.enter();
            let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
            let _ = done.send(futures::executor::block_on(checked.check_on(&clock)));
        });
        let result = ended
            .recv_timeout(Duration::from_secs(10))
            .expect("the check never returned: the probe's end waits for the lock its start holds");
        assert_eq!(result, Ok(()));
        assert!(
            health.state().running.is_none(),
            "the probe is still running"
        );
    }

    /// A probe that a request of a down shard started, on a runtime that
    /// then shut down with nobody waiting on the probe, is not left running:
    /// on another runtime the shard's requests would fail at once for good,
    /// the stale probe too old to wait on and no new one started.
    #[test]
    fn a_probe_dropped_with_its_runtime_unawaited_is_not_left_running() {
        let health = unreachable_shard();
        let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
        health.state().down = Some(("refused".to_owned(), 0));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            assert!(matches!(health.gate(&clock), Gate::HalfOpen { .. }));
        });
        assert!(health.state().running.is_some(), "no probe was started");
        drop(runtime);
        assert!(
            health.state().running.is_none(),
            "the probe of a runtime that shut down is still running"
        );
        assert_eq!(health.down_cause().as_deref(), Some("refused"));
    }

    /// The end of a probe that is no longer the running one (its record
    /// was replaced) leaves the running probe's record alone: one probe at
    /// a time holds even when an older one's task ends late.
    #[test]
    fn an_older_probes_end_leaves_the_running_probe() {
        let health = unreachable_shard();
        let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
        let (_, older) = health.record(&mut health.state(), &clock);
        let (_, newer) = health.record(&mut health.state(), &clock);
        drop(older);
        let running = health.state().running.as_ref().map(|r| r.generation);
        assert_eq!(running, Some(2), "the older probe's end cleared the newer");
        drop(newer);
        assert!(health.state().running.is_none());
    }

    /// A refused connection is a shard down.
    #[tokio::test]
    async fn a_refused_connection_is_down() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let url = DatabaseUrl::new(format!("postgres://app:hunter2@127.0.0.1:{port}/shop"));
        let health = ShardHealth::new(&url, Duration::from_secs(5));
        let Err(ProbeFailure::Down(cause)) = health.connect_once().await else {
            panic!("expected the shard down");
        };
        assert!(
            cause.starts_with("error communicating with database: "),
            "{cause}"
        );
        assert!(!cause.contains("hunter2"), "{cause}");
    }

    /// The breaker's decision: which request errors make it probe (and so
    /// possibly mark the shard down).
    #[test]
    fn the_breaker_suspects_connection_failures_but_not_a_full_server() {
        use crate::error::tests::{conn_err, too_many_clients};
        use sea_orm::sqlx;
        let db = |source| {
            ShardError::db(
                crate::error::Origin::Group("Customer"),
                "s1",
                "begin",
                source,
            )
        };
        assert!(!suspects_down(&db(too_many_clients())));
        assert!(suspects_down(&db(conn_err(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused)
        )))));
        assert!(suspects_down(&db(sea_orm::DbErr::ConnectionAcquire(
            sea_orm::error::ConnAcquireErr::Timeout
        ))));
        assert!(!suspects_down(&db(sea_orm::DbErr::Exec(
            sea_orm::RuntimeErr::Internal("syntax error".to_owned())
        ))));
        assert!(!suspects_down(&ShardError::Timeout {
            group: "Customer",
            shard: "s1".to_owned(),
            after: Duration::from_secs(1),
        }));
    }
}
