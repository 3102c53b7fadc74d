//! Setting the ticket servers' places up: recording and confirming them
//! ([`Ids::record_places`]), adopting servers set up before places were
//! recorded ([`Ids::adopt_places`]), and clearing unconfirmed records
//! ([`Ids::clear_unconfirmed_places`]).

use crate::error::{Result, ShardError, Subsystem};
use crate::id_spec::check_name;
use crate::ids::handle::Ids;
use crate::ids::places::{PLACE_TABLE, READ_PLACE};
use crate::ids::servers::{TicketServer, Tickets};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::sync::atomic::Ordering;

const RECORD_PLACE: &str = "record the ticket server's place";
const CONFIRM_PLACE: &str = "confirm the ticket server's place";

impl TicketServer {
    /// The last ticket of each sequence on this server that has handed one
    /// out (each `tickets_<name>` table's row).
    async fn ticket_counters(&self) -> Result<Vec<(String, i64)>> {
        let backend = self.conn.get_database_backend();
        let err = |source| {
            ShardError::db(
                crate::error::Origin::table(Subsystem::Ids, "tickets_*"),
                self.name.clone(),
                "read the ticket counters",
                source,
            )
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
}

impl Tickets {
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

    /// [`Ids::record_places`], and with `adopt` [`Ids::adopt_places`].
    pub(super) async fn record_places(&self, adopt: bool) -> Result<()> {
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

impl Ids {
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
}
