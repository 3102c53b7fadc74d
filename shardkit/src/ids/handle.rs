//! [`Ids`], the id service of a cluster: sequences, snowflakes, and
//! creating and advancing sequences on the ticket servers.

use crate::clock::Clock;
use crate::error::{Result, ShardError, Subsystem};
use crate::id_spec::{DEFAULT_BLOCK, IdStrategy, SnowflakeLayout, check_name};
use crate::ids::lock::lock;
use crate::ids::sequence::Sequence;
use crate::ids::servers::{TicketServer, Tickets, no_servers};
use crate::ids::snowflake::{Snowflake, uuid_v7};
use crate::topology::IdsConfig;
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// The registry of sequences on every ticket server.
const SEQUENCES_TABLE: &str = "shardkit_ticket_sequences";

/// The id service of a [`Cluster`](crate::Cluster): `cluster.ids()`, a
/// handle (owned, cheap to clone; clones share the sequences and their
/// prefetched blocks).
///
/// Ownership runs one way, so dropping the cluster and its handles closes
/// the ticket pools: `Ids` → its [`Sequence`]s → the shared ticket servers. A sequence never
/// points back at `Ids`, and a prefetch in flight holds its sequence only
/// until its one request ends.
#[derive(Clone)]
pub struct Ids {
    pub(super) tickets: Arc<Tickets>,
    sequences: Arc<Mutex<HashMap<String, Arc<Sequence>>>>,
    snowflake: Arc<Snowflake>,
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
            tickets: Arc::new(Tickets::new(servers, config)),
            sequences: Arc::default(),
            snowflake: Arc::new(snowflake),
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
            let err = |source| {
                ShardError::db(
                    crate::error::Origin::table(Subsystem::Ids, format!("tickets_{name}")),
                    server.name.clone(),
                    format!("create sequence {name}"),
                    source,
                )
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
                        .map_err(|source| {
                            ShardError::db(
                                crate::error::Origin::table(Subsystem::Ids, SEQUENCES_TABLE),
                                server.name.clone(),
                                "list sequences",
                                source,
                            )
                        });
                }
                Err(source) => {
                    last = Some(ShardError::db(
                        crate::error::Origin::table(Subsystem::Ids, SEQUENCES_TABLE),
                        server.name.clone(),
                        "list sequences",
                        source,
                    ))
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
        let seq = Arc::new(Sequence::new(name, block, Arc::clone(&self.tickets)));
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
        let min_ticket = id / seq.block() + 1;
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
                .map_err(|source| {
                    ShardError::db(
                        crate::error::Origin::table(Subsystem::Ids, format!("tickets_{name}")),
                        server.name.clone(),
                        format!("advance sequence {name}"),
                        source,
                    )
                })?;
        }
        seq.discard_blocks();
        Ok(())
    }
}

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
