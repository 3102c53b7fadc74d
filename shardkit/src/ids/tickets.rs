//! Drawing one ticket: round robin over the ticket servers, skipping a
//! server that failed recently, and the one round trip a ticket takes
//! (`REPLACE INTO` on MySQL/MariaDB, an upsert elsewhere).

use crate::error::{Result, ShardError, Subsystem};
use crate::ids::lock::lock;
use crate::ids::places::PlaceCheck;
use crate::ids::servers::{TicketServer, Tickets, no_servers};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Tickets {
    /// One ticket for sequence `name`: round-robin over the servers, skipping
    /// servers that failed recently.
    pub(super) async fn ticket(&self, name: &str) -> Result<u64> {
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
        let mut last = None;
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
                    causes.push(format!("{}: {}", server.name, err.report()));
                    last = Some(std::sync::Arc::new(err));
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
            last,
        })
    }
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

/// Why one server gave no ticket.
enum TicketFailure {
    /// The server has no `tickets_<sequence>` table: a configuration error,
    /// not an outage.
    NoSuchSequence,
    /// The config is wrong for this server (see
    /// [`Tickets::check_place`]): no server is asked.
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
        TicketFailure::Failed(ShardError::db(
            crate::error::Origin::table(Subsystem::Ids, format!("tickets_{name}")),
            server.name.clone(),
            format!("ticket {name}"),
            source,
        ))
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
