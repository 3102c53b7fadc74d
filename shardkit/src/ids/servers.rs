//! The ticket servers: one connection each ([`TicketServer`]) and the list
//! every sequence of a cluster shares ([`Tickets`]).

use crate::error::ShardError;
use crate::ids::lock::lock;
use crate::topology::IdsConfig;
use sea_orm::DatabaseConnection;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::time::{Duration, Instant};

/// A connected ticket server.
pub(crate) struct TicketServer {
    pub(crate) name: String,
    pub(crate) conn: DatabaseConnection,
    pub(super) down_until: Mutex<Option<Instant>>,
    /// The server's recorded place matched this config's (checked once per
    /// process; see [`Tickets::check_place`]).
    pub(super) place_checked: AtomicBool,
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

    pub(super) fn is_down(&self, now: Instant) -> bool {
        lock(&self.down_until).is_some_and(|until| until > now)
    }
}

/// The ticket servers and how requests are spread over them: what every
/// [`Sequence`](crate::ids::Sequence) of a cluster shares.
pub(super) struct Tickets {
    pub(super) servers: Vec<TicketServer>,
    /// The servers' names in order, a JSON array: part of each server's
    /// recorded place.
    pub(super) roster: String,
    pub(super) next_server: AtomicUsize,
    pub(super) config: IdsConfig,
    pub(super) requests: AtomicU64,
}

impl Tickets {
    /// The list `servers`, in order, with `config`'s settings.
    pub(super) fn new(servers: Vec<TicketServer>, config: IdsConfig) -> Self {
        Tickets {
            roster: serde_json::to_string(
                &servers.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            )
            .expect("a list of strings serializes"),
            servers,
            next_server: AtomicUsize::new(0),
            config,
            requests: AtomicU64::new(0),
        }
    }

    /// How long one ticket request or set-up step may wait on one server
    /// (`ids.timeout_ms`, default 2 s): a server that accepts and never
    /// answers is given up on rather than waited for.
    pub(super) fn step_timeout(&self) -> Duration {
        Duration::from_millis(self.config.timeout_ms.unwrap_or(2000))
    }
}

pub(super) fn no_servers() -> ShardError {
    ShardError::config("ids.servers", "no ticket servers are configured")
}
