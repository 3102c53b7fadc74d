//! Globally unique ids.
//!
//! - **Tickets** (Flickr): a ticket server is a database with one
//!   `tickets_<sequence>` table per named sequence. Server `i` of `n` hands out
//!   tickets `≡ i + 1 (mod n)`, so two (or `n`) servers never overlap and any
//!   one of them can serve alone. On MySQL/MariaDB a ticket is Flickr's
//!   `REPLACE INTO tickets_x (stub) VALUES ('a')` with `auto_increment_increment`
//!   / `auto_increment_offset` set on every session the pool opens; on
//!   PostgreSQL and SQLite it is an upsert `... DO UPDATE SET id = id + n
//!   RETURNING id`. Either way, one round trip. Requests round-robin over the
//!   servers; a server that errors or times out is skipped for
//!   `retry_after_ms` and the next one is asked.
//! - **Segments** (hi-lo, Meituan Leaf): ticket `t` reserves the block of ids
//!   `[t·B, (t+1)·B)`. Blocks are handed out from memory; once 10% of the
//!   current block is used, the next block is fetched in the background
//!   (double buffering), so [`Sequence::next`] does not wait on a database in
//!   steady state. `B = 1` is exactly Flickr: one ticket per id, no prefetch.
//!   **A crash loses at most the unused rest of the current and the prefetched
//!   block** (gaps, never duplicates).
//! - **UUIDv7** ([`uuid_v7`]): time-ordered, index-friendly, monotonic within
//!   the process.
//! - **Snowflake** ([`Snowflake`]): 64-bit `time | worker | sequence`
//!   (default 41/10/12 bits) from a fixed epoch, with a clock-rollback policy.
//! - **Shard-encoded** ([`Cluster::next_encoded_id`], [`Cluster::route_id`]): a
//!   sequence id with the row's bucket in its low 13 bits (Instagram), so the
//!   shard is known from the id alone ([`Cluster::next_encoded_id`]).

use crate::entity::{EntityGroup, ShardKey, ShardedEntity, table_name};
use crate::error::{Result, ShardError, Subsystem};

/// The registry of sequences on every ticket server.
const SEQUENCES_TABLE: &str = "shardkit_ticket_sequences";
/// Each ticket server's recorded place among the servers.
const PLACE_TABLE: &str = "shardkit_ticket_place";
const READ_PLACE: &str = "read the ticket server's place";
const RECORD_PLACE: &str = "record the ticket server's place";
const CONFIRM_PLACE: &str = "confirm the ticket server's place";
use crate::pipeline::{WriteCtx, WriteOp, WriteStage};
use crate::topology::{IdsConfig, ShardId, Target, Topology};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use crate::clock::{Clock, SystemClock};
pub(crate) use crate::id_spec::check_name;
pub use crate::id_spec::{
    BUCKET_BITS, DEFAULT_BLOCK, IdStrategy, MAX_BLOCK, SNOWFLAKE_EPOCH_MS, SnowflakeLayout,
};

impl Ids {
    /// A fresh id for `strategy`, as a SeaORM value. A shard-encoded id
    /// needs the row's key: [`IdStrategy::Encoded`] is refused here (use
    /// [`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id); a
    /// `ShardTx` insert fills it itself).
    pub async fn generate(&self, strategy: IdStrategy) -> Result<sea_orm::Value> {
        Ok(match strategy {
            IdStrategy::Ticket(sequence) => self.next(sequence).await?.into(),
            IdStrategy::UuidV7 => uuid_v7().into(),
            IdStrategy::Snowflake => self.snowflake()?.into(),
            IdStrategy::Encoded(sequence) => {
                return Err(ShardError::config(
                    format!("ids.sequences.{sequence}"),
                    "a shard-encoded id carries the row's bucket: call \
                     `cluster.next_encoded_id::<Group>(sequence, &key)`",
                ));
            }
        })
    }
}

/// A connected ticket server.
pub(crate) struct TicketServer {
    pub(crate) name: String,
    pub(crate) conn: DatabaseConnection,
    down_until: Mutex<Option<Instant>>,
    /// The server's recorded place matched this config's (checked once per
    /// process; see [`TicketServer::check_place`]).
    place_checked: AtomicBool,
}

impl TicketServer {
    pub(crate) fn new(name: String, conn: DatabaseConnection) -> Self {
        TicketServer {
            name,
            conn,
            down_until: Mutex::new(None),
            place_checked: AtomicBool::new(false),
        }
    }

    fn is_down(&self, now: Instant) -> bool {
        lock(&self.down_until).is_some_and(|until| until > now)
    }

    fn db_error(&self, operation: &str, source: sea_orm::DbErr) -> ShardError {
        ShardError::Db {
            origin: Box::new(crate::error::Origin::table(Subsystem::Ids, PLACE_TABLE)),
            shard: self.name.clone(),
            operation: operation.into(),
            source,
        }
    }

    /// The last ticket of each sequence on this server that has handed one
    /// out (each `tickets_<name>` table's row).
    async fn ticket_counters(&self) -> Result<Vec<(String, i64)>> {
        let backend = self.conn.get_database_backend();
        let err = |source| ShardError::Db {
            origin: Box::new(crate::error::Origin::table(Subsystem::Ids, "tickets_*")),
            shard: self.name.clone(),
            operation: "read the ticket counters".into(),
            source,
        };
        // `_` is a LIKE wildcard: the names are filtered again below.
        let tables = match backend {
            DbBackend::MySql => {
                "SELECT TABLE_NAME AS name FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'tickets_%'"
            }
            DbBackend::Postgres => {
                "SELECT table_name::text AS name FROM information_schema.tables \
                 WHERE table_schema = current_schema() AND table_name LIKE 'tickets_%'"
            }
            _ => "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'tickets_%'",
        };
        let rows = self
            .conn
            .query_all_raw(Statement::from_string(backend, tables))
            .await
            .map_err(err)?;
        let mut counters = Vec::new();
        for row in rows {
            let table: String = row.try_get("", "name").map_err(err)?;
            let Some(name) = table.strip_prefix("tickets_") else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            let last = self
                .conn
                .query_one_raw(Statement::from_string(
                    backend,
                    format!("SELECT id FROM {table}"),
                ))
                .await
                .map_err(err)?;
            if let Some(last) = last {
                counters.push((table, last.try_get::<i64>("", "id").map_err(err)?));
            }
        }
        Ok(counters)
    }

    /// The place recorded on this server, and whether it is confirmed.
    async fn recorded_place(&self, entry: &str) -> Result<Option<(Place, bool)>> {
        let row = self
            .conn
            .query_one_raw(Statement::from_string(
                self.conn.get_database_backend(),
                format!("SELECT position, servers, confirmed FROM {PLACE_TABLE} WHERE stub = 'a'"),
            ))
            .await
            .map_err(|source| {
                if crate::error::is_missing_table(&source) {
                    return ShardError::config(
                        entry,
                        format!(
                            "ticket server `{}` has no table `{PLACE_TABLE}`: run \
                             `cluster.migrate::<Migrator>()` with shardkit_migration's migrations",
                            self.name
                        ),
                    );
                }
                self.db_error(READ_PLACE, source)
            })?;
        let Some(row) = row else { return Ok(None) };
        let read = |source| self.db_error(READ_PLACE, source);
        let place = Place {
            position: row.try_get("", "position").map_err(read)?,
            servers: row.try_get("", "servers").map_err(read)?,
        };
        Ok(Some((place, row.try_get("", "confirmed").map_err(read)?)))
    }
}

/// A ticket server's place as it records it ([`Ids::places`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TicketPlace {
    /// The server's place, from 1: it hands out tickets
    /// `≡ position (mod servers.len())`.
    pub position: u32,
    /// The names of the ticket servers of the list it was set up with, in
    /// order.
    pub servers: Vec<String>,
    /// Every server of that list agreed when it was set up.
    pub confirmed: bool,
}

/// One ticket server as [`Ids::places`] finds it.
#[derive(Debug)]
pub struct ServerPlace {
    /// The server's name (`ids.servers`).
    pub name: String,
    /// What it records (`None`: no place yet), or why it could not be read.
    pub recorded: Result<Option<TicketPlace>>,
    /// Its recorded place is this config's and confirmed: it serves tickets.
    pub serves: bool,
}

/// A ticket server's place among the ticket servers, as
/// `shardkit_ticket_place` records it: server `position` (1-based) of the
/// list `servers` (their names, a JSON array), handing out tickets
/// `≡ position (mod len)`.
#[derive(Debug, PartialEq)]
struct Place {
    position: i32,
    servers: String,
}

impl Place {
    /// Records this place on a server that holds none; a no-op on one that
    /// does (the first record stays).
    fn record(&self) -> sea_orm::sea_query::InsertStatement {
        let col = sea_orm::sea_query::Alias::new;
        sea_orm::sea_query::Query::insert()
            .into_table(col(PLACE_TABLE))
            .columns([col("stub"), col("position"), col("servers")])
            .values_panic([
                "a".into(),
                self.position.into(),
                self.servers.clone().into(),
            ])
            // A no-op update rather than DO NOTHING: one form every backend
            // takes.
            .on_conflict(
                sea_orm::sea_query::OnConflict::column(col("stub"))
                    .update_column(col("stub"))
                    .to_owned(),
            )
            .to_owned()
    }
}

impl Tickets {
    /// The place this config gives server `index`.
    fn place(&self, index: usize) -> Place {
        Place {
            position: index as i32 + 1,
            servers: self.roster.clone(),
        }
    }

    /// How long one ticket request or set-up step may wait on one server
    /// (`ids.timeout_ms`, default 2 s): a server that accepts and never
    /// answers is given up on rather than waited for.
    fn step_timeout(&self) -> Duration {
        Duration::from_millis(self.config.timeout_ms.unwrap_or(2000))
    }

    /// `step` on `server`, given up after [`step_timeout`](Self::step_timeout).
    async fn within<T>(
        &self,
        server: &TicketServer,
        operation: &str,
        step: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let timeout = self.step_timeout();
        tokio::time::timeout(timeout, step)
            .await
            .unwrap_or_else(|_| {
                Err(server.db_error(
                    operation,
                    sea_orm::DbErr::Conn(sea_orm::RuntimeErr::Internal(format!(
                        "no answer within {timeout:?}"
                    ))),
                ))
            })
    }

    /// `statement` on `server`, set-up step `operation`, within the step
    /// timeout; the rows it touched. Tests: the failpoint
    /// `shardkit::ids::<failpoint>::<server>` stops the process once the
    /// step is done (`place_recorded`, `place_confirmed`, `place_cleared`).
    async fn step(
        &self,
        server: &TicketServer,
        operation: &str,
        statement: &impl sea_orm::StatementBuilder,
        failpoint: &str,
    ) -> Result<u64> {
        let done = self
            .within(server, operation, async {
                server
                    .conn
                    .execute(statement)
                    .await
                    .map_err(|source| server.db_error(operation, source))
            })
            .await?;
        #[cfg(feature = "failpoints")]
        fail::fail_point!(
            &format!("shardkit::ids::{failpoint}::{}", server.name),
            |_| Err(server.db_error(
                operation,
                sea_orm::DbErr::Custom(format!("failpoint shardkit::ids::{failpoint}")),
            ))
        );
        #[cfg(not(feature = "failpoints"))]
        let _ = failpoint;
        Ok(done.rows_affected())
    }

    /// Records this list's place on server `index` (a no-op where a place
    /// is recorded).
    async fn record_place(&self, index: usize) -> Result<u64> {
        let record = self.place(index).record();
        self.step(
            &self.servers[index],
            RECORD_PLACE,
            &record,
            "place_recorded",
        )
        .await
    }

    /// Server `index`'s record went away during this set-up.
    fn removed_while_set_up(&self, index: usize) -> ShardError {
        ShardError::config(
            self.entry(index),
            format!(
                "ticket server `{}`'s place was removed while it was being set up \
                 (`clear_unconfirmed_places` ran at the same time): set up again",
                self.servers[index].name
            ),
        )
    }

    fn entry(&self, index: usize) -> String {
        format!("ids.servers[{index}] ({:?})", self.servers[index].name)
    }

    /// The error for server `index`, whose recorded place is `recorded`
    /// (confirmed or not).
    fn misplaced(&self, index: usize, recorded: &Place, confirmed: bool) -> ShardError {
        let count =
            |list: &str| serde_json::from_str::<Vec<String>>(list).map_or(0, |names| names.len());
        let name = &self.servers[index].name;
        let (position, of, list) = (
            recorded.position,
            count(&recorded.servers),
            &recorded.servers,
        );
        let ours = format!(
            "server {} of {} ({})",
            index + 1,
            self.servers.len(),
            self.roster
        );
        ShardError::config(
            self.entry(index),
            if confirmed {
                format!(
                    "ticket server `{name}` was set up as server {position} of {of} ({list}), but \
                     this config lists it as {ours}: drawing tickets would hand out ids another \
                     server has already given. Keep `ids.servers` as it was set up: the same \
                     servers, names and order (a server that is down is skipped; it need not be \
                     removed)"
                )
            } else {
                format!(
                    "ticket server `{name}` holds an unconfirmed place for another list, server \
                     {position} of {of} ({list}), and this config lists it as {ours}: two set-ups \
                     with different lists ran at once, or one stopped partway. No ticket has been \
                     drawn from it. If this config's list is the right one, remove the \
                     unconfirmed places with `cluster.ids().clear_unconfirmed_places()` \
                     (`shardctl ids clear-unconfirmed-places`, while no set-up runs) and set up \
                     again"
                )
            },
        )
    }

    /// Makes sure server `index` holds the place this config gives it, with
    /// every other server agreeing ([`Ids::record_places`] confirmed it),
    /// before a ticket is drawn from it. A config that moved the server, or
    /// added or removed one, would hand out tickets another server has
    /// already given: refused. Once it matched, this process does not ask
    /// again.
    async fn check_place(&self, index: usize) -> std::result::Result<(), PlaceCheck> {
        let server = &self.servers[index];
        if server.place_checked.load(Ordering::Acquire) {
            return Ok(());
        }
        let entry = self.entry(index);
        let recorded = server
            .recorded_place(&entry)
            .await
            .map_err(|err| match err {
                // No place table: every server would say the same.
                err @ ShardError::Config { .. } => PlaceCheck::Refused(err),
                err => PlaceCheck::Failed(err),
            })?;
        match recorded {
            Some((recorded, confirmed)) if recorded != self.place(index) => Err(
                PlaceCheck::Refused(self.misplaced(index, &recorded, confirmed)),
            ),
            Some((_, true)) => {
                server.place_checked.store(true, Ordering::Release);
                Ok(())
            }
            // This list's set-up has not finished here (or never ran): the
            // server serves no ticket, its peers may.
            _ => Err(PlaceCheck::Failed(ShardError::config(
                entry,
                format!(
                    "ticket server `{}` has no confirmed place among the ticket servers: run \
                     `cluster.migrate::<Migrator>()` or `cluster.ids().record_places()` with \
                     every ticket server reachable",
                    server.name
                ),
            ))),
        }
    }

    /// [`Ids::record_places`], and with `adopt` [`Ids::adopt_places`].
    async fn record_places(&self, adopt: bool) -> Result<()> {
        use sea_orm::sea_query::ExprTrait;
        if self
            .servers
            .iter()
            .all(|s| s.place_checked.load(Ordering::Acquire))
        {
            return Ok(());
        }
        let col = sea_orm::sea_query::Alias::new;
        // 1. What every server holds, before anything is written: a server
        //    recorded for another list stops the set-up here.
        let mut held = Vec::with_capacity(self.servers.len());
        for (i, server) in self.servers.iter().enumerate() {
            let recorded = self
                .within(server, READ_PLACE, server.recorded_place(&self.entry(i)))
                .await?;
            if let Some((place, confirmed)) = &recorded
                && *place != self.place(i)
            {
                return Err(self.misplaced(i, place, *confirmed));
            }
            held.push(recorded);
        }
        // 2. A server without a record may get one only if it is new: no
        //    other server of the list is confirmed yet (else its database is
        //    not the one that was set up), and it has handed out no ticket
        //    (else its place predates the records: `adopt` checks it).
        let confirmed_peer = held.iter().position(|h| matches!(h, Some((_, true))));
        for (i, server) in self.servers.iter().enumerate() {
            if held[i].is_some() {
                continue;
            }
            if let Some(peer) = confirmed_peer {
                return Err(ShardError::config(
                    self.entry(i),
                    format!(
                        "ticket server `{}` has no recorded place, but `{}` was confirmed with \
                         this list: `{}` is not the database that was set up (a new database in \
                         a ticket server's place would hand out the tickets its predecessor \
                         gave). Point `ids.servers[{i}]` at the server's own database",
                        server.name, self.servers[peer].name, server.name
                    ),
                ));
            }
            self.within(
                server,
                "read the ticket counters",
                self.check_history(i, adopt),
            )
            .await?;
        }
        // Tests: `shardkit::ids::places_read::<first server>` runs between
        // reading the servers and recording them.
        #[cfg(feature = "failpoints")]
        fail::fail_point!(&format!(
            "shardkit::ids::places_read::{}",
            self.servers[0].name
        ));
        // 3. Record the missing places, each written once: when two lists
        //    record at once, each server keeps the first.
        for (i, held) in held.iter().enumerate() {
            if held.is_none() {
                self.record_place(i).await?;
            }
        }
        // 4. Every record agrees with this list. Two lists recording at once
        //    may each have won some servers; a list confirms only if it won
        //    every one of its servers.
        for (i, server) in self.servers.iter().enumerate() {
            let entry = self.entry(i);
            match self
                .within(server, READ_PLACE, server.recorded_place(&entry))
                .await?
            {
                Some((recorded, _)) if recorded == self.place(i) => {}
                Some((recorded, confirmed)) => {
                    return Err(self.misplaced(i, &recorded, confirmed));
                }
                None => return Err(self.removed_while_set_up(i)),
            }
        }
        // 5. Confirmed (this list's record only): a server hands out tickets
        //    from now on. A process that dies before this step, or halfway
        //    through it, leaves unconfirmed records; running this again
        //    finishes it.
        for (i, server) in self.servers.iter().enumerate() {
            let place = self.place(i);
            let confirm = sea_orm::sea_query::Query::update()
                .table(col(PLACE_TABLE))
                .value(col("confirmed"), true)
                .and_where(sea_orm::sea_query::Expr::col(col("stub")).eq("a"))
                .and_where(sea_orm::sea_query::Expr::col(col("position")).eq(place.position))
                .and_where(sea_orm::sea_query::Expr::col(col("servers")).eq(place.servers))
                .to_owned();
            let entry = self.entry(i);
            let mut recorded_again = false;
            loop {
                self.step(server, CONFIRM_PLACE, &confirm, "place_confirmed")
                    .await?;
                // Serve only what is on the server: a record cleared
                // meanwhile was not confirmed by the update.
                match self
                    .within(server, READ_PLACE, server.recorded_place(&entry))
                    .await?
                {
                    Some((recorded, true)) if recorded == self.place(i) => {
                        server.place_checked.store(true, Ordering::Release);
                        break;
                    }
                    // Cleared after step 4 read it here (a clear run during
                    // this set-up), perhaps with a peer confirmed already:
                    // left without a record, the server could be taken by
                    // another list. It is this list's; recorded again.
                    None if !recorded_again => {
                        recorded_again = true;
                        self.record_place(i).await?;
                    }
                    _ => return Err(self.removed_while_set_up(i)),
                }
            }
        }
        Ok(())
    }

    /// Refuses to record server `index`'s place if it has handed out
    /// tickets already, unless `adopt`: then every sequence's counter must be
    /// `≡ position (mod n)`, as it is on the server this list's place was
    /// given to.
    async fn check_history(&self, index: usize, adopt: bool) -> Result<()> {
        let server = &self.servers[index];
        let counters = server.ticket_counters().await?;
        let Some((table, last)) = counters.first() else {
            return Ok(());
        };
        if !adopt {
            return Err(ShardError::config(
                self.entry(index),
                format!(
                    "ticket server `{}` has handed out tickets (`{table}` is at {last}) but holds \
                     no recorded place: it was set up before shardkit recorded ticket servers' \
                     places. Make sure `ids.servers` lists the servers as they were set up (the \
                     same servers, in the same order), then call `cluster.ids().adopt_places()` \
                     (`shardctl ids adopt-places`) once",
                    server.name
                ),
            ));
        }
        let (position, n) = (index as i64 + 1, self.servers.len() as i64);
        for (table, last) in &counters {
            if last.rem_euclid(n) != position % n {
                return Err(ShardError::config(
                    self.entry(index),
                    format!(
                        "ticket server `{}`'s `{table}` is at {last}, which is not ≡ {position} \
                         (mod {n}): the server was not set up as server {position} of {n}, so \
                         this list ({}) is not the one it was set up with",
                        server.name, self.roster
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The id service of a [`Cluster`]: `cluster.ids()`.
///
/// Ownership runs one way, so dropping the cluster closes the ticket pools:
/// `Ids` → its [`Sequence`]s → the shared ticket servers. A sequence never
/// points back at `Ids`, and a prefetch in flight holds its sequence only
/// until its one request ends.
pub struct Ids {
    tickets: Arc<Tickets>,
    sequences: Mutex<HashMap<String, Arc<Sequence>>>,
    snowflake: Snowflake,
}

/// The ticket servers and how requests are spread over them: what every
/// [`Sequence`] of a cluster shares.
struct Tickets {
    servers: Vec<TicketServer>,
    /// The servers' names in order, a JSON array: part of each server's
    /// recorded place.
    roster: String,
    next_server: AtomicUsize,
    config: IdsConfig,
    requests: AtomicU64,
}

impl std::fmt::Debug for Ids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ids")
            .field(
                "servers",
                &self
                    .tickets
                    .servers
                    .iter()
                    .map(|s| &s.name)
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Ids {
    pub(crate) fn new(
        servers: Vec<TicketServer>,
        config: IdsConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        for (name, seq) in &config.sequences {
            check_name(name)?;
            if seq.block == Some(0) {
                return Err(ShardError::config(
                    format!("ids.sequences.{name}.block"),
                    "a block holds at least one id",
                ));
            }
        }
        let layout = config
            .snowflake
            .map_or(Ok(SnowflakeLayout::default()), |c| c.layout())?;
        let snowflake = Snowflake::new(layout, config.worker_id.unwrap_or(0), clock)?;
        Ok(Ids {
            tickets: Arc::new(Tickets {
                roster: serde_json::to_string(
                    &servers.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
                )
                .expect("a list of strings serializes"),
                servers,
                next_server: AtomicUsize::new(0),
                config,
                requests: AtomicU64::new(0),
            }),
            sequences: Mutex::new(HashMap::new()),
            snowflake,
        })
    }

    /// How many ticket requests have reached a server (successful or not).
    pub fn ticket_requests(&self) -> u64 {
        self.tickets.requests.load(Ordering::Relaxed)
    }

    /// The ticket servers, in order.
    pub fn servers(&self) -> impl Iterator<Item = &str> {
        self.tickets.servers.iter().map(|s| s.name.as_str())
    }

    /// Creates every sequence `[ids.sequences]` names on every ticket
    /// server ([`create_sequence`](Self::create_sequence)); nothing without
    /// ticket servers. [`Cluster::migrate`](crate::Cluster::migrate) calls it.
    pub async fn create_configured_sequences(&self) -> Result<()> {
        if self.tickets.servers.is_empty() {
            return Ok(());
        }
        self.tickets.record_places(false).await?;
        for name in self.tickets.config.sequences.keys() {
            self.create_sequence(name).await?;
        }
        Ok(())
    }

    /// Creates sequence `name` on every ticket server (its `tickets_<name>`
    /// table and its registry row). Idempotent.
    pub async fn create_sequence(&self, name: &str) -> Result<()> {
        check_name(name)?;
        self.tickets.record_places(false).await?;
        for server in &self.tickets.servers {
            let backend = server.conn.get_database_backend();
            let err = |source| ShardError::Db {
                origin: Box::new(crate::error::Origin::table(
                    Subsystem::Ids,
                    format!("tickets_{name}"),
                )),
                shard: server.name.clone(),
                operation: format!("create sequence {name}"),
                source,
            };
            server
                .conn
                .execute(&shardkit_migration::ticket_table(backend, name))
                .await
                .map_err(err)?;
            let insert = sea_orm::sea_query::Query::insert()
                .into_table(sea_orm::sea_query::Alias::new("shardkit_ticket_sequences"))
                .columns([sea_orm::sea_query::Alias::new("name")])
                .values_panic([name.into()])
                // A no-op update rather than DO NOTHING: one form every backend takes.
                .on_conflict(
                    sea_orm::sea_query::OnConflict::column(sea_orm::sea_query::Alias::new("name"))
                        .update_column(sea_orm::sea_query::Alias::new("name"))
                        .to_owned(),
                )
                .to_owned();
            server.conn.execute(&insert).await.map_err(err)?;
        }
        Ok(())
    }

    /// Records each ticket server's place (server `i` of `n` hands out
    /// tickets `≡ i + 1 (mod n)`) on the server, together with the whole
    /// `ids.servers` list, and confirms it once every server's record agrees.
    /// A server hands out tickets only to a config that matches its
    /// confirmed record, so two processes whose `ids.servers` differ (a
    /// server added, removed or moved) never draw the same id: the one that
    /// does not match gets [`ShardError::Config`] naming `ids.servers[i]`.
    ///
    /// Every ticket server must be reachable. Every server's record is read
    /// before any is written, and a server without one gets one only if it
    /// is new: none of its peers is confirmed yet (else it is not the
    /// database that was set up) and it has handed out no ticket (a server
    /// set up before places were recorded: see
    /// [`adopt_places`](Self::adopt_places)). Idempotent; the first list to
    /// record a server keeps it. A set-up that stopped partway is finished
    /// by running it again; two lists that set up at once may split the
    /// servers (a list is confirmed only if it won all of its own), and
    /// then the losing lists stay unconfirmed until
    /// [`clear_unconfirmed_places`](Self::clear_unconfirmed_places). [`Cluster::migrate`](crate::Cluster::migrate),
    /// [`create_sequence`](Self::create_sequence) and
    /// [`create_configured_sequences`](Self::create_configured_sequences) call it.
    pub async fn record_places(&self) -> Result<()> {
        self.tickets.record_places(false).await
    }

    /// [`record_places`](Self::record_places) for ticket servers set up
    /// before shardkit recorded places, which have handed out tickets but
    /// hold no record (`record_places` refuses them, since the first list to
    /// record would win, right or wrong). Call it once, with `ids.servers` as
    /// the servers were set up; it checks what it can (each sequence's last
    /// ticket is `≡ i + 1 (mod n)` on server `i`; nothing to check with one
    /// server) and records the list.
    pub async fn adopt_places(&self) -> Result<()> {
        self.tickets.record_places(true).await
    }

    /// Removes the unconfirmed place records of the ticket servers and
    /// returns how many it removed. An unconfirmed record has never served
    /// a ticket: it is left by a set-up that stopped before confirming
    /// anything, or by two set-ups with different lists that ran at once
    /// (then a list that did not win all of its servers stays unconfirmed
    /// until the records are gone).
    ///
    /// Every server a record names must be in this config, and none of them
    /// may hold that list's confirmed record: a set-up that confirmed some
    /// servers before it stopped is finished by running it again with its
    /// list, never cleared (clearing it would let another list give a
    /// server the residue a confirmed one serves). Run it while no set-up
    /// runs, then set up again with the right list. `shardctl ids
    /// clear-unconfirmed-places` runs it.
    pub async fn clear_unconfirmed_places(&self) -> Result<u64> {
        use sea_orm::sea_query::ExprTrait;
        let tickets = &self.tickets;
        let mut held = Vec::with_capacity(tickets.servers.len());
        for (i, server) in tickets.servers.iter().enumerate() {
            let entry = tickets.entry(i);
            held.push(
                tickets
                    .within(server, READ_PLACE, server.recorded_place(&entry))
                    .await?,
            );
        }
        for (i, record) in held.iter().enumerate() {
            let Some((place, false)) = record else {
                continue;
            };
            let names = serde_json::from_str::<Vec<String>>(&place.servers).unwrap_or_default();
            if let Some(missing) = names
                .iter()
                .find(|name| !tickets.servers.iter().any(|s| &s.name == *name))
            {
                return Err(ShardError::config(
                    tickets.entry(i),
                    format!(
                        "ticket server `{}` holds an unconfirmed place of the list {}, which \
                         names `{missing}`, a server this config does not list: clear it from a \
                         config that lists every server of that list",
                        tickets.servers[i].name, place.servers
                    ),
                ));
            }
            if let Some(j) = held
                .iter()
                .position(|other| matches!(other, Some((p, true)) if p.servers == place.servers))
            {
                return Err(ShardError::config(
                    tickets.entry(j),
                    format!(
                        "the set-up of the list {} confirmed ticket server `{}` before it \
                         stopped: finish it by running the set-up again with that list \
                         (`cluster.migrate`, `cluster.ids().record_places()`); its unconfirmed \
                         places are not cleared",
                        place.servers, tickets.servers[j].name
                    ),
                ));
            }
        }
        let col = sea_orm::sea_query::Alias::new;
        let mut removed = 0;
        let mut cleared = Vec::new();
        for (i, (server, record)) in tickets.servers.iter().zip(&held).enumerate() {
            let Some((place, false)) = record else {
                continue;
            };
            // Only the record read above, and only while unconfirmed.
            let delete = sea_orm::sea_query::Query::delete()
                .from_table(col(PLACE_TABLE))
                .and_where(sea_orm::sea_query::Expr::col(col("confirmed")).eq(false))
                .and_where(sea_orm::sea_query::Expr::col(col("position")).eq(place.position))
                .and_where(sea_orm::sea_query::Expr::col(col("servers")).eq(place.servers.clone()))
                .to_owned();
            let gone = tickets
                .step(
                    server,
                    "clear an unconfirmed place",
                    &delete,
                    "place_cleared",
                )
                .await?;
            if gone > 0 {
                cleared.push((i, place));
            }
            removed += gone;
        }
        // A set-up of a cleared list that ran meanwhile (against the advice
        // above) may have confirmed one of its servers: its other servers
        // get their records back, or another list could take them.
        for (i, place) in &cleared {
            for (j, server) in tickets.servers.iter().enumerate() {
                let entry = tickets.entry(j);
                let now = tickets
                    .within(server, READ_PLACE, server.recorded_place(&entry))
                    .await?;
                if matches!(&now, Some((p, true)) if p.servers == place.servers) {
                    for (k, place) in &cleared {
                        let server = &tickets.servers[*k];
                        tickets
                            .step(server, RECORD_PLACE, &place.record(), "place_recorded")
                            .await?;
                    }
                    return Err(ShardError::config(
                        tickets.entry(*i),
                        format!(
                            "a set-up of the list {} confirmed ticket server `{}` while its \
                             places were being cleared: the cleared places are restored; finish \
                             that set-up (run it again with that list)",
                            place.servers, server.name
                        ),
                    ));
                }
            }
        }
        Ok(removed)
    }

    /// Every ticket server's recorded place, read from all of them at once
    /// (each within `ids.timeout_ms`), and whether it serves this config:
    /// what an operator checks after set-up, and where a server this process
    /// cannot reach shows (ticket pools open on first use, so
    /// [`Cluster::connect`](crate::Cluster::connect) does not tell).
    pub async fn places(&self) -> Vec<ServerPlace> {
        let tickets = &self.tickets;
        futures::future::join_all(tickets.servers.iter().enumerate().map(
            |(i, server)| async move {
                let entry = tickets.entry(i);
                let recorded = tickets
                    .within(server, READ_PLACE, server.recorded_place(&entry))
                    .await;
                let serves =
                    matches!(&recorded, Ok(Some((place, true))) if *place == tickets.place(i));
                ServerPlace {
                    name: server.name.clone(),
                    recorded: recorded.map(|held| {
                        held.map(|(place, confirmed)| TicketPlace {
                            position: u32::try_from(place.position).unwrap_or(0),
                            servers: serde_json::from_str(&place.servers).unwrap_or_default(),
                            confirmed,
                        })
                    }),
                    serves,
                }
            },
        ))
        .await
    }

    /// The sequences the first reachable ticket server holds.
    pub async fn sequences(&self) -> Result<Vec<String>> {
        let mut last = None;
        for server in &self.tickets.servers {
            let stmt = Statement::from_string(
                server.conn.get_database_backend(),
                "SELECT name FROM shardkit_ticket_sequences ORDER BY name",
            );
            match server.conn.query_all_raw(stmt).await {
                Ok(rows) => {
                    return rows
                        .iter()
                        .map(|r| r.try_get::<String>("", "name"))
                        .collect::<std::result::Result<_, _>>()
                        .map_err(|source| ShardError::Db {
                            origin: Box::new(crate::error::Origin::table(
                                Subsystem::Ids,
                                SEQUENCES_TABLE,
                            )),
                            shard: server.name.clone(),
                            operation: "list sequences".into(),
                            source,
                        });
                }
                Err(source) => {
                    last = Some(ShardError::Db {
                        origin: Box::new(crate::error::Origin::table(
                            Subsystem::Ids,
                            SEQUENCES_TABLE,
                        )),
                        shard: server.name.clone(),
                        operation: "list sequences".into(),
                        source,
                    })
                }
            }
        }
        Err(last.unwrap_or_else(no_servers))
    }

    /// The handle of sequence `name` (cheap to keep; [`Ids::next`] looks it up
    /// on every call). A handle keeps the ticket servers' pools open while it
    /// lives, even after the cluster is dropped.
    pub fn sequence(&self, name: &str) -> Result<Arc<Sequence>> {
        check_name(name)?;
        let mut sequences = lock(&self.sequences);
        if let Some(seq) = sequences.get(name) {
            return Ok(Arc::clone(seq));
        }
        let block = self
            .tickets
            .config
            .sequences
            .get(name)
            .and_then(|s| s.block)
            .unwrap_or(DEFAULT_BLOCK);
        let seq = Arc::new(Sequence {
            name: name.to_owned(),
            block,
            tickets: Arc::clone(&self.tickets),
            state: Mutex::new(Segment::default()),
            fetched: tokio::sync::Notify::new(),
        });
        sequences.insert(name.to_owned(), Arc::clone(&seq));
        Ok(seq)
    }

    /// The next id of sequence `name`.
    pub async fn next(&self, name: &str) -> Result<i64> {
        self.sequence(name)?.next().await
    }

    /// A snowflake id from this process's worker (see [`Snowflake`]).
    pub fn snowflake(&self) -> Result<i64> {
        self.snowflake.next()
    }

    /// Makes sure sequence `name` never hands out `id` or anything below it
    /// again (for rows inserted with explicit ids). Discards this process's
    /// buffered blocks; other processes' buffers are theirs to drain.
    pub async fn advance_past(&self, name: &str, id: i64) -> Result<()> {
        let seq = self.sequence(name)?;
        let id = u64::try_from(id).unwrap_or(0);
        // The first ticket whose block lies wholly above `id`.
        let min_ticket = id / seq.block + 1;
        let servers = &self.tickets.servers;
        let n = servers.len();
        for (i, server) in servers.iter().enumerate() {
            self.tickets
                .check_place(i)
                .await
                .map_err(ShardError::from)?;
            let backend = server.conn.get_database_backend();
            let sql = match backend {
                DbBackend::MySql => {
                    format!("ALTER TABLE tickets_{name} AUTO_INCREMENT = {min_ticket}")
                }
                _ => {
                    // Keep the server's residue: the next upsert returns `v + n`.
                    let residue = ((i + 1) % n) as u64;
                    let base = min_ticket.saturating_sub(n as u64);
                    let v = base - (base % n as u64) + residue;
                    let v = if v + n as u64 >= min_ticket {
                        v
                    } else {
                        v + n as u64
                    };
                    format!(
                        "INSERT INTO tickets_{name} (stub, id) VALUES ('a', {v}) ON CONFLICT (stub) \
                         DO UPDATE SET id = CASE WHEN tickets_{name}.id < {v} THEN {v} ELSE tickets_{name}.id END"
                    )
                }
            };
            server
                .conn
                .execute_unprepared(&sql)
                .await
                .map_err(|source| ShardError::Db {
                    origin: Box::new(crate::error::Origin::table(
                        Subsystem::Ids,
                        format!("tickets_{name}"),
                    )),
                    shard: server.name.clone(),
                    operation: format!("advance sequence {name}"),
                    source,
                })?;
        }
        seq.discard_blocks();
        Ok(())
    }
}

impl Tickets {
    /// One ticket for sequence `name`: round-robin over the servers, skipping
    /// servers that failed recently.
    async fn ticket(&self, name: &str) -> Result<u64> {
        // Tests: `return(<ms>)` on `shardkit::ids::ticket::<sequence>` holds
        // that sequence's request for <ms> before it asks a server (it holds
        // no connection meanwhile).
        #[cfg(feature = "failpoints")]
        if let Some(ms) = (|| {
            fail::fail_point!(&format!("shardkit::ids::ticket::{name}"), |ms: Option<
                String,
            >| {
                ms.and_then(|ms| ms.parse::<u64>().ok())
            });
            None
        })() {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if self.servers.is_empty() {
            return Err(no_servers());
        }
        let n = self.servers.len();
        let start = self.next_server.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        // Healthy servers first, then the ones marked down (better a retry
        // than no id at all).
        let order: Vec<usize> = (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| !self.servers[i].is_down(now))
            .chain(
                (0..n)
                    .map(|k| (start + k) % n)
                    .filter(|&i| self.servers[i].is_down(now)),
            )
            .collect();
        let timeout = self.step_timeout();
        let retry_after = Duration::from_millis(self.config.retry_after_ms.unwrap_or(1000));
        let mut causes = Vec::new();
        for i in order {
            let server = &self.servers[i];
            let deadline = tokio::time::Instant::now() + timeout;
            let mut attempts = 0;
            let result = loop {
                self.requests.fetch_add(1, Ordering::Relaxed);
                crate::metrics::ticket_request(&server.name);
                attempts += 1;
                let request = async {
                    self.check_place(i).await.map_err(|check| match check {
                        PlaceCheck::Refused(err) => TicketFailure::Config(err),
                        PlaceCheck::Failed(err) => TicketFailure::Failed(err),
                    })?;
                    ticket_from(server, i, n, name).await
                };
                match tokio::time::timeout_at(deadline, request).await {
                    // Concurrent `REPLACE INTO`s of one stub deadlock on
                    // MySQL/MariaDB (the server rolls one back), and on
                    // PostgreSQL two first tickets of a sequence both insert
                    // its row, the second failing on the primary key
                    // (`ON CONFLICT` covers only `stub`): the server is
                    // fine, and the statement, its own transaction, is
                    // simply run again (the row exists by then).
                    Ok(Err(TicketFailure::Failed(err)))
                        if (err.retry() == crate::error::Retry::Transaction
                            || is_first_ticket_race(&err))
                            && attempts < MAX_TICKET_ATTEMPTS => {}
                    result => break result,
                }
            };
            match result {
                Ok(Ok(ticket)) => {
                    *lock(&server.down_until) = None;
                    return Ok(ticket);
                }
                // The server answered; the sequence is what is missing. Every
                // server would say the same, and none of them is down.
                Ok(Err(TicketFailure::Config(err))) => return Err(err),
                Ok(Err(TicketFailure::NoSuchSequence)) => {
                    return Err(ShardError::config(
                        format!("ids.sequences.{name}"),
                        format!(
                            "ticket server `{}` has no table `tickets_{name}`: create the \
                             sequence with `cluster.setup::<YourEntity>()` for the entities \
                             whose ids draw from it, `cluster.ids().create_sequence(\"{name}\")` \
                             or shardkit_migration::CreateTicketSequence before drawing ids",
                            server.name
                        ),
                    ));
                }
                Ok(Err(TicketFailure::Failed(err))) => {
                    causes.push(format!("{}: {}", server.name, err.report()))
                }
                Err(_) => causes.push(format!("{}: no answer within {timeout:?}", server.name)),
            }
            tracing::warn!(server = %server.name, sequence = name, "ticket server failed; trying the next one");
            crate::metrics::ticket_failover(&server.name);
            *lock(&server.down_until) = Some(Instant::now() + retry_after);
        }
        Err(ShardError::IdsUnavailable {
            sequence: name.to_owned(),
            causes: causes.join("; "),
        })
    }
}

fn no_servers() -> ShardError {
    ShardError::config("ids.servers", "no ticket servers are configured")
}

/// Whether a ticket statement failed on a unique key: the first tickets of
/// a sequence racing to insert its row.
fn is_first_ticket_race(err: &ShardError) -> bool {
    matches!(err, ShardError::Db { source, .. } if crate::error::is_unique_violation(source))
}

/// How many times one server is asked in a row when the database aborts the
/// ticket statement (deadlock, serialization failure) before the next server
/// is tried.
const MAX_TICKET_ATTEMPTS: u32 = 20;

/// Why a server's place did not check out.
enum PlaceCheck {
    /// The config is wrong for the server: no server is asked.
    Refused(ShardError),
    /// The server cannot serve now (unreachable, or this list's set-up has
    /// not finished on it): the next one is asked.
    Failed(ShardError),
}

impl From<PlaceCheck> for ShardError {
    fn from(check: PlaceCheck) -> Self {
        match check {
            PlaceCheck::Refused(err) | PlaceCheck::Failed(err) => err,
        }
    }
}

/// Why one server gave no ticket.
enum TicketFailure {
    /// The server has no `tickets_<sequence>` table: a configuration error,
    /// not an outage.
    NoSuchSequence,
    /// The config is wrong for this server (see
    /// [`TicketServer::check_place`]): no server is asked.
    Config(ShardError),
    /// Anything else: the next server is asked.
    Failed(ShardError),
}

/// One round trip to server `index` of `count`.
async fn ticket_from(
    server: &TicketServer,
    index: usize,
    count: usize,
    name: &str,
) -> std::result::Result<u64, TicketFailure> {
    let backend = server.conn.get_database_backend();
    let err = |source: sea_orm::DbErr| {
        if crate::error::is_missing_table(&source) {
            return TicketFailure::NoSuchSequence;
        }
        TicketFailure::Failed(ShardError::Db {
            origin: Box::new(crate::error::Origin::table(
                Subsystem::Ids,
                format!("tickets_{name}"),
            )),
            shard: server.name.clone(),
            operation: format!("ticket {name}"),
            source,
        })
    };
    let ticket = match backend {
        DbBackend::MySql => {
            let res = server
                .conn
                .execute_unprepared(&format!("REPLACE INTO tickets_{name} (stub) VALUES ('a')"))
                .await
                .map_err(err)?;
            res.last_insert_id()
        }
        _ => {
            let sql = format!(
                "INSERT INTO tickets_{name} (stub, id) VALUES ('a', {first}) ON CONFLICT (stub) \
                 DO UPDATE SET id = tickets_{name}.id + {count} RETURNING id",
                first = index + 1
            );
            let row = server
                .conn
                .query_one_raw(Statement::from_string(backend, sql))
                .await
                .map_err(err)?
                .ok_or_else(|| err(sea_orm::DbErr::RecordNotFound("ticket row".into())))?;
            let id: i64 = row.try_get("", "id").map_err(err)?;
            id as u64
        }
    };
    // Tickets start at 1. A 0 is MySQL's "nothing was generated" (a table
    // whose `id` is not AUTO_INCREMENT), and would repeat on every request.
    if ticket == 0 {
        return Err(TicketFailure::Failed(ShardError::config(
            format!("ids.servers[{index}] ({:?})", server.name),
            format!(
                "`tickets_{name}` generated no ticket: its `id` must be an AUTO_INCREMENT \
                 BIGINT (see shardkit_migration::ticket_table)"
            ),
        )));
    }
    // A session without the right increment/offset would hand out another
    // server's tickets: refuse rather than risk a duplicate.
    if count > 1 && ticket % count as u64 != (index as u64 + 1) % count as u64 {
        return Err(TicketFailure::Failed(ShardError::config(
            format!("ids.servers[{index}] ({:?})", server.name),
            format!(
                "ticket {ticket} is not ≡ {} (mod {count}): the server's session settings are wrong",
                index + 1
            ),
        )));
    }
    Ok(ticket)
}

/// One named sequence's blocks.
pub struct Sequence {
    name: String,
    block: u64,
    tickets: Arc<Tickets>,
    state: Mutex<Segment>,
    /// Wakes the callers waiting for a block when a fetch ends.
    fetched: tokio::sync::Notify,
}

#[derive(Default)]
struct Segment {
    next: u64,
    end: u64,
    /// When `next` reaches this, the next block is fetched.
    prefetch_at: u64,
    ready: Option<(u64, u64)>,
    /// A ticket request for the next block is under way (a background
    /// prefetch, or a caller's own request).
    fetching: bool,
    /// Bumped by [`Ids::advance_past`]: a fetch that started before it
    /// throws its block away.
    epoch: u64,
    /// Failed fetches so far, and the last one's error: a caller that waited
    /// on a fetch that failed reports it instead of asking again.
    failures: u64,
    last_error: Option<FetchError>,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("name", &self.name)
            .field("block", &self.block)
            .finish()
    }
}

/// Ends a fetch however it ends (done, failed, or its caller went away), so
/// a waiter can take over.
struct FetchDone<'a>(&'a Sequence);

impl Drop for FetchDone<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).fetching = false;
        self.0.fetched.notify_waiters();
    }
}

impl Sequence {
    /// Ids per ticket.
    pub fn block(&self) -> u64 {
        self.block
    }

    /// The next id: from memory when the current block has one left; the
    /// database is only awaited when no block is buffered. With a block of 1
    /// (Flickr) every id is its own ticket request, and concurrent callers'
    /// requests run side by side, up to the ticket pools' size.
    pub async fn next(self: &Arc<Self>) -> Result<i64> {
        if self.block == 1 {
            let ticket = self.tickets.ticket(&self.name).await?;
            return self.block_of(ticket).map(|(start, _)| start as i64);
        }
        loop {
            let waiting = {
                let mut st = lock(&self.state);
                if st.next < st.end {
                    let id = st.next;
                    st.next += 1;
                    if st.next >= st.prefetch_at && st.ready.is_none() && !st.fetching {
                        st.fetching = true;
                        let seq = Arc::clone(self);
                        // The task holds the sequence only while its one
                        // request lasts (at most `timeout_ms` per server).
                        tokio::spawn(async move {
                            if let Err(err) = seq.fetch().await {
                                tracing::warn!(sequence = %seq.name, error = %err.report(), "prefetching the next block failed; the next caller that needs it asks again");
                            }
                        });
                    }
                    return Ok(id as i64);
                }
                if let Some((start, end)) = st.ready.take() {
                    st.next = start;
                    st.end = end;
                    st.prefetch_at = start + (self.block / 10).max(1);
                    continue;
                }
                if st.fetching {
                    // Registered before the lock is released, so the fetch's
                    // wake-up cannot be missed.
                    Some((self.fetched.notified(), st.failures))
                } else {
                    st.fetching = true;
                    None
                }
            };
            match waiting {
                None => self.fetch().await?,
                Some((notified, failures)) => {
                    notified.await;
                    // The fetch this caller waited on failed: report it
                    // rather than queue up behind the same dead servers.
                    let st = lock(&self.state);
                    if st.failures != failures
                        && st.ready.is_none()
                        && st.next >= st.end
                        && let Some(error) = &st.last_error
                    {
                        return Err(self.replay_error(error));
                    }
                }
            }
        }
    }

    /// Asks for a ticket and installs its block as the ready one. The caller
    /// has set `fetching`.
    async fn fetch(&self) -> Result<()> {
        let _done = FetchDone(self);
        let epoch = lock(&self.state).epoch;
        let result = self
            .tickets
            .ticket(&self.name)
            .await
            .and_then(|ticket| self.block_of(ticket));
        let mut st = lock(&self.state);
        match result {
            Ok(block) => {
                if st.epoch == epoch {
                    st.ready = Some(block);
                }
                Ok(())
            }
            Err(err) => {
                st.failures += 1;
                st.last_error = Some(recordable(&err));
                Err(err)
            }
        }
    }

    /// The ids ticket `ticket` reserves, `[t·B, (t+1)·B)`; refused when they
    /// would not fit in an `i64`.
    fn block_of(&self, ticket: u64) -> Result<(u64, u64)> {
        ticket
            .checked_mul(self.block)
            .and_then(|start| Some((start, start.checked_add(self.block)?)))
            .filter(|&(_, end)| end - 1 <= i64::MAX as u64)
            .ok_or_else(|| ShardError::SequenceExhausted {
                sequence: self.name.clone(),
                ticket,
                block: self.block,
            })
    }

    /// Forgets the buffered blocks (and any block a fetch under way brings).
    fn discard_blocks(&self) {
        let mut st = lock(&self.state);
        st.next = 0;
        st.end = 0;
        st.prefetch_at = 0;
        st.ready = None;
        st.epoch += 1;
    }
}

/// A failed fetch, kept to be reported to every caller that waited on it.
enum FetchError {
    /// A [`ShardError::Config`] (no such sequence).
    Config { entry: String, message: String },
    /// A [`ShardError::SequenceExhausted`].
    Exhausted { ticket: u64, block: u64 },
    /// The causes of an [`ShardError::IdsUnavailable`].
    Unavailable(String),
}

fn recordable(err: &ShardError) -> FetchError {
    match err {
        ShardError::Config { entry, message } => FetchError::Config {
            entry: entry.clone(),
            message: message.clone(),
        },
        ShardError::SequenceExhausted { ticket, block, .. } => FetchError::Exhausted {
            ticket: *ticket,
            block: *block,
        },
        ShardError::IdsUnavailable { causes, .. } => FetchError::Unavailable(causes.clone()),
        other => FetchError::Unavailable(other.to_string()),
    }
}

impl Sequence {
    fn replay_error(&self, error: &FetchError) -> ShardError {
        match error {
            FetchError::Config { entry, message } => {
                ShardError::config(entry.clone(), message.clone())
            }
            FetchError::Exhausted { ticket, block } => ShardError::SequenceExhausted {
                sequence: self.name.clone(),
                ticket: *ticket,
                block: *block,
            },
            FetchError::Unavailable(causes) => ShardError::IdsUnavailable {
                sequence: self.name.clone(),
                causes: causes.clone(),
            },
        }
    }
}

/// A time-ordered UUID (version 7): index-friendly like COMB GUIDs, and
/// monotonic within this process (the `uuid` crate's v7 context). Store it as
/// 16 bytes (`uuid` on PostgreSQL, `BINARY(16)`/`BLOB` elsewhere).
pub fn uuid_v7() -> uuid::Uuid {
    uuid::Uuid::now_v7()
}

/// Snowflake ids: `(ms since 2026-01-01 UTC) << (worker_bits + sequence_bits)
/// | worker << sequence_bits | sequence`.
///
/// Clock rollback: if the clock steps back by at most 5 ms the generator
/// waits it out; a larger step is refused with
/// [`ShardError::ClockMovedBackwards`]. It never returns a duplicate.
pub struct Snowflake {
    layout: SnowflakeLayout,
    worker: u64,
    clock: Arc<dyn Clock>,
    max_backward: u64,
    state: Mutex<(u64, u64)>,
}

impl std::fmt::Debug for Snowflake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snowflake")
            .field("layout", &self.layout)
            .field("worker", &self.worker)
            .finish()
    }
}

impl Snowflake {
    /// A generator for `worker` with `clock`.
    pub fn new(layout: SnowflakeLayout, worker: u64, clock: Arc<dyn Clock>) -> Result<Self> {
        layout.check()?;
        layout.check_worker(worker)?;
        Ok(Snowflake {
            layout,
            worker,
            clock,
            max_backward: 5,
            state: Mutex::new((0, 0)),
        })
    }

    /// How far back (ms) the clock may step before ids are refused.
    pub fn with_max_backward_ms(mut self, ms: u64) -> Self {
        self.max_backward = ms;
        self
    }

    /// The next id.
    pub fn next(&self) -> Result<i64> {
        let seq_mask = (1u64 << self.layout.sequence_bits) - 1;
        let mut st = lock(&self.state);
        let (last, seq) = *st;
        let mut now = self.elapsed_ms()?;
        if now < last {
            if last - now > self.max_backward {
                return Err(ShardError::ClockMovedBackwards { millis: last - now });
            }
            while now < last {
                std::hint::spin_loop();
                now = self.elapsed_ms()?;
            }
        }
        let seq = if now == last {
            let next = (seq + 1) & seq_mask;
            if next == 0 {
                // 2^sequence_bits ids this millisecond: wait for the next one.
                while now <= last {
                    std::hint::spin_loop();
                    now = self.elapsed_ms()?;
                }
            }
            next
        } else {
            0
        };
        if now >> self.layout.time_bits != 0 {
            return Err(ShardError::config(
                "ids.snowflake",
                "the time bits are exhausted",
            ));
        }
        *st = (now, seq);
        let id = (now << (self.layout.worker_bits + self.layout.sequence_bits))
            | (self.worker << self.layout.sequence_bits)
            | seq;
        Ok(id as i64)
    }

    fn elapsed_ms(&self) -> Result<u64> {
        let now = self.clock.now_millis();
        now.checked_sub(SNOWFLAKE_EPOCH_MS)
            .ok_or_else(|| ShardError::ClockMovedBackwards {
                millis: SNOWFLAKE_EPOCH_MS - now,
            })
    }

    /// Splits an id into (Unix ms, worker, sequence).
    pub fn decode(&self, id: i64) -> (u64, u64, u64) {
        let id = id as u64;
        let seq = id & ((1 << self.layout.sequence_bits) - 1);
        let worker = (id >> self.layout.sequence_bits) & ((1 << self.layout.worker_bits) - 1);
        let ms = id >> (self.layout.worker_bits + self.layout.sequence_bits);
        (ms + SNOWFLAKE_EPOCH_MS, worker, seq)
    }
}

fn encoded_bucket<G: EntityGroup>(topology: &Topology, key: &G::Key) -> Result<u32> {
    match topology.placement(G::NAME)? {
        crate::topology::Placement::Hash { buckets, .. } if *buckets <= 1 << BUCKET_BITS => {
            Ok((key.partition_hash() % u64::from(*buckets)) as u32)
        }
        _ => Err(ShardError::config(
            format!("groups.{}", G::NAME),
            "shard-encoded ids need a hash placement with at most 8192 buckets",
        )),
    }
}

impl Ids {
    /// See [`Cluster::next_encoded_id`](crate::Cluster::next_encoded_id).
    pub(crate) async fn next_encoded<G: EntityGroup>(
        &self,
        topology: &Topology,
        name: &str,
        key: &G::Key,
    ) -> Result<i64> {
        let bucket = encoded_bucket::<G>(topology, key)?;
        let id = self.next(name).await?;
        let id = u64::try_from(id).unwrap_or_default();
        if id >> (63 - BUCKET_BITS) != 0 {
            return Err(ShardError::config(
                format!("ids.sequences.{name}"),
                "the sequence has outgrown the 50 bits a shard-encoded id leaves it",
            ));
        }
        Ok(((id << BUCKET_BITS) | u64::from(bucket)) as i64)
    }
}

/// See [`Cluster::route_id`](crate::Cluster::route_id).
pub(crate) fn route_id<G: EntityGroup>(topology: &Topology, id: i64) -> Result<Target> {
    match topology.placement(G::NAME)? {
        crate::topology::Placement::Hash { buckets, owner } if *buckets <= 1 << BUCKET_BITS => {
            let bucket = (id as u64 & ((1 << BUCKET_BITS) - 1)) as u32;
            if bucket >= *buckets {
                return Err(ShardError::Unroutable {
                    group: G::NAME,
                    key: format!("id {id}"),
                    reason: format!(
                        "bucket {bucket} is outside the group's {buckets} buckets: not a shard-encoded id of this group"
                    ),
                });
            }
            let shard: ShardId = owner.get(bucket);
            Ok(Target {
                shard,
                bucket: Some(bucket),
            })
        }
        _ => Err(ShardError::config(
            format!("groups.{}", G::NAME),
            "shard-encoded ids need a hash placement with at most 8192 buckets",
        )),
    }
}

/// The write stage of ids (see [`crate::pipeline`]): an insert whose
/// `#[shardkit(id = "...")]` primary key is unset gets a fresh id.
#[doc(hidden)]
pub struct FillIds {
    ids: Arc<Ids>,
}

impl FillIds {
    pub(crate) fn new(ids: Arc<Ids>) -> Self {
        FillIds { ids }
    }
}

impl WriteStage for FillIds {
    async fn prepare<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &mut E::ActiveModel,
    ) -> Result<()> {
        use sea_orm::ActiveModelTrait;
        let Some((column, strategy)) = E::ID else {
            return Ok(());
        };
        if op != WriteOp::Insert || !model.get(column).is_not_set() {
            return Ok(());
        }
        // Boxed, so writes of entities without ids do not carry its state.
        let id = match strategy {
            IdStrategy::Encoded(sequence) => {
                // The pipeline checked the row's key is the transaction's.
                let key = E::active_shard_key(model).ok_or(ShardError::MissingShardKey {
                    entity: table_name::<E>(),
                    column: E::SHARD_KEY_FIELD,
                })?;
                let topology = ctx.shards.topology();
                Box::pin(self.ids.next_encoded::<E::Group>(topology, sequence, &key))
                    .await?
                    .into()
            }
            strategy => Box::pin(self.ids.generate(strategy)).await?,
        };
        model.try_set(column, id).map_err(|source| ShardError::Db {
            origin: Box::new(crate::error::Origin::Group(<E::Group as EntityGroup>::NAME)),
            shard: ctx.shard_name.to_owned(),
            operation: format!("insert {}", table_name::<E>()),
            source,
        })
    }
}
