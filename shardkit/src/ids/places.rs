//! Each ticket server's place among the ticket servers: the record
//! (`shardkit_ticket_place`), reading and checking it before a ticket is
//! drawn, and what [`Ids::places`] reports.

use crate::error::{Result, ShardError, Subsystem};
use crate::ids::handle::Ids;
use crate::ids::servers::{TicketServer, Tickets};
use sea_orm::{ConnectionTrait, Statement};
use std::sync::atomic::Ordering;

/// Each ticket server's recorded place among the servers.
pub(super) const PLACE_TABLE: &str = "shardkit_ticket_place";
pub(super) const READ_PLACE: &str = "read the ticket server's place";

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
pub(super) struct Place {
    pub(super) position: i32,
    pub(super) servers: String,
}

impl Place {
    /// Records this place on a server that holds none; a no-op on one that
    /// does (the first record stays).
    pub(super) fn record(&self) -> sea_orm::sea_query::InsertStatement {
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

/// Why a server's place did not check out.
pub(super) enum PlaceCheck {
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

impl TicketServer {
    pub(super) fn db_error(&self, operation: &str, source: sea_orm::DbErr) -> ShardError {
        ShardError::db(
            crate::error::Origin::table(Subsystem::Ids, PLACE_TABLE),
            self.name.clone(),
            operation,
            source,
        )
    }

    /// The place recorded on this server, and whether it is confirmed.
    pub(super) async fn recorded_place(&self, entry: &str) -> Result<Option<(Place, bool)>> {
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

impl Tickets {
    /// The place this config gives server `index`.
    pub(super) fn place(&self, index: usize) -> Place {
        Place {
            position: index as i32 + 1,
            servers: self.roster.clone(),
        }
    }

    /// `step` on `server`, given up after [`step_timeout`](Self::step_timeout).
    pub(super) async fn within<T>(
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
    pub(super) async fn step(
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

    pub(super) fn entry(&self, index: usize) -> String {
        format!("ids.servers[{index}] ({:?})", self.servers[index].name)
    }

    /// The error for server `index`, whose recorded place is `recorded`
    /// (confirmed or not).
    pub(super) fn misplaced(&self, index: usize, recorded: &Place, confirmed: bool) -> ShardError {
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
    pub(super) async fn check_place(&self, index: usize) -> std::result::Result<(), PlaceCheck> {
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
}

impl Ids {
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
}
