//! Checking a config by building its topology, and the connections an
//! instance of it opens.

use crate::error::Result;
use crate::topology::config::pool_size;
use crate::topology::config::{
    ClusterConfig, ConnectionBudget, DEFAULT_SIDE_CONNECTIONS, SQLX_MAX_CONNECTIONS, ServerBudget,
};
use crate::topology::url::DatabaseUrl;

impl ClusterConfig {
    /// The most connections one instance of this cluster opens, per
    /// server: per shard `max_connections + side_connections + 1` (the
    /// breaker's probe), plus `max_connections` per directory and per
    /// ticket server on that server. Multiply by the number of instances
    /// (application processes, `shardctl`) and keep it under the server's
    /// own limit (`max_connections` on PostgreSQL and MySQL/MariaDB).
    pub fn connection_budget(&self) -> Result<ConnectionBudget> {
        let topology = crate::topology::layout::Topology::build(self)?;
        let main = self.pool.max_connections.unwrap_or(SQLX_MAX_CONNECTIONS);
        let side = self
            .pool
            .side_connections
            .unwrap_or(DEFAULT_SIDE_CONNECTIONS);
        let mut servers: Vec<ServerBudget> = Vec::new();
        let mut entry = |url: &DatabaseUrl| -> usize {
            let server = url.host().unwrap_or_else(|| "sqlite".to_owned());
            match servers.iter().position(|s| s.server == server) {
                Some(i) => i,
                None => {
                    servers.push(ServerBudget {
                        server,
                        shards: 0,
                        directories: 0,
                        ticket_servers: 0,
                        connections: 0,
                    });
                    servers.len() - 1
                }
            }
        };
        let mut add = Vec::new();
        for shard in topology.shards() {
            let url = &shard.url;
            let connections = if url.is_sqlite_memory() {
                1
            } else if url.host().is_none() {
                main + side
            } else {
                main + side + 1
            };
            add.push((entry(url), 0, connections));
        }
        for directory in topology.directories() {
            add.push((entry(&directory.url), 1, pool_size(&directory.url, main)));
        }
        for tickets in topology.ticket_servers() {
            add.push((entry(&tickets.url), 2, pool_size(&tickets.url, main)));
        }
        for (i, kind, connections) in add {
            let server = &mut servers[i];
            match kind {
                0 => server.shards += 1,
                1 => server.directories += 1,
                _ => server.ticket_servers += 1,
            }
            server.connections += connections;
        }
        Ok(ConnectionBudget {
            max_connections: main,
            side_connections: side,
            servers,
        })
    }
}

impl ClusterConfig {
    /// Checks everything that parsing cannot: unique names, references that
    /// resolve, bucket and key ranges that cover their space exactly once, URLs
    /// that parse. The first problem is returned, naming its entry.
    pub fn validate(&self) -> Result<()> {
        super::Topology::build(self).map(|_| ())
    }
}
