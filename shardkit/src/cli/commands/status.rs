//! `status`: every shard, the connection budget, migrations, placements,
//! global indexes, rollouts and unfinished bucket moves, in one report.

use crate::cli::commands::migrate::{migration_json, migration_table};
use crate::cli::commands::output::{Outcome, table};
use crate::cli::commands::rebalance::{MOVE_COLUMNS, move_json, move_row, moves_of};
use crate::cli::commands::rollout::rollout_status;
use crate::cli::registry::Registry;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::topology::{ConnectionBudget, Placement};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// How long `status` waits for one shard.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The report's text so far, and whether a section found a problem.
#[derive(Default)]
struct Report {
    text: String,
    problem: bool,
}

/// The whole report; `budget` is the connection budget of the
/// application's config (before the command line made it connect lazily).
pub(super) async fn status(
    cluster: &Cluster,
    registry: &Registry,
    budget: &ConnectionBudget,
) -> Result<Outcome> {
    let mut report = Report::default();
    let shards = shards(cluster, &mut report).await;
    let replicas = replicas(cluster, &mut report).await;
    // The connection budget: what one instance of this config may open.
    let (budget_json, budget_text) = budget_status(budget);
    let _ = writeln!(report.text, "\n{budget_text}");
    let migrations = migrations(cluster, registry, &shards, &mut report).await;
    let groups = placements(cluster, &mut report)?;
    let indexes = indexes(cluster, registry, &mut report).await;
    let rollouts = rollouts(cluster, registry, &mut report).await;
    let moves = moves(cluster, registry, &mut report).await?;
    Ok(Outcome {
        json: json!({
            "shards": shards,
            "replicas": replicas,
            "connection_budget": budget_json,
            "migrations": migrations,
            "groups": groups,
            "indexes": indexes,
            "rollouts": rollouts,
            "moves": moves,
        }),
        text: report.text,
        problem: report.problem,
    })
}

/// Every shard, probed at once: reachable, latency, pool, server version.
async fn shards(cluster: &Cluster, report: &mut Report) -> Vec<Value> {
    let names: Vec<String> = cluster
        .topology()
        .shard_names()
        .map(str::to_owned)
        .collect();
    let shards = futures::future::join_all(names.iter().map(|n| probe(cluster, n))).await;
    let mut t = table(&[
        "shard",
        "backend",
        "reachable",
        "latency",
        "pool open/idle",
        "server",
    ]);
    for s in &shards {
        let reachable = s["reachable"].as_bool().unwrap_or(false);
        report.problem |= !reachable;
        t.add_row(vec![
            s["name"].as_str().unwrap_or_default().to_owned(),
            s["backend"].as_str().unwrap_or_default().to_owned(),
            if reachable {
                "yes".to_owned()
            } else {
                format!("NO: {}", s["error"].as_str().unwrap_or_default())
            },
            format!("{:.1} ms", s["latency_ms"].as_f64().unwrap_or_default()),
            format!("{}/{}", s["pool"]["open"], s["pool"]["idle"]),
            s["server_version"].as_str().unwrap_or("-").to_owned(),
        ]);
    }
    let _ = writeln!(report.text, "shards\n{t}");
    shards
}

/// Every shard's read replicas, probed now: in the rotation or not, lag.
/// Nothing is printed for a cluster without replicas.
async fn replicas(cluster: &Cluster, report: &mut Report) -> Vec<Value> {
    let replicas = cluster.replicas().await;
    if replicas.is_empty() {
        return Vec::new();
    }
    let mut t = table(&["replica", "shard", "in rotation", "lag"]);
    let mut out = Vec::with_capacity(replicas.len());
    for r in &replicas {
        report.problem |= !r.in_rotation;
        t.add_row(vec![
            r.name.clone(),
            r.shard.clone(),
            match &r.error {
                None if r.in_rotation => "yes".to_owned(),
                None => "no".to_owned(),
                Some(cause) => format!("NO: {cause}"),
            },
            r.lag.map_or("unknown".to_owned(), |lag| {
                format!("{} ms", lag.as_millis())
            }),
        ]);
        out.push(json!({
            "name": r.name,
            "shard": r.shard,
            "url": r.url,
            "in_rotation": r.in_rotation,
            "lag_ms": r.lag.map(|lag| lag.as_millis() as u64),
            "error": r.error,
        }));
    }
    let _ = writeln!(report.text, "\nreplicas\n{t}");
    out
}

/// One shard's health as `status` reports it.
async fn probe(cluster: &Cluster, name: &str) -> Value {
    let spec = cluster
        .topology()
        .shards()
        .iter()
        .find(|s| s.name == name)
        .expect("a configured shard");
    let db = cluster.connection(name).expect("a configured shard");
    let backend = db.get_database_backend();
    let version_sql = match backend {
        DbBackend::Sqlite => "SELECT sqlite_version() AS v",
        _ => "SELECT version() AS v",
    };
    // A fresh connection first (the shard's breaker probe: a refused
    // connection fails at once, a hung server within the probe timeout),
    // then the version through the pool.
    let started = Instant::now();
    let (reachable, version, error) = match cluster.probe_shard(name).await {
        Err(cause) => (false, None, Some(cause)),
        Ok(()) => match tokio::time::timeout(
            PROBE_TIMEOUT,
            db.query_one_raw(Statement::from_string(backend, version_sql)),
        )
        .await
        {
            Ok(Ok(row)) => (
                true,
                row.and_then(|r| r.try_get::<String>("", "v").ok()),
                None,
            ),
            Ok(Err(err)) => (
                false,
                None,
                Some(crate::error::DriverCause(&err).to_string()),
            ),
            Err(_) => (
                false,
                None,
                Some(format!("no answer within {PROBE_TIMEOUT:?}")),
            ),
        },
    };
    let latency_ms = started.elapsed().as_secs_f64() * 1_000.0;
    let (size, idle) = match backend {
        DbBackend::Postgres => {
            let pool = db.get_postgres_connection_pool();
            (pool.size(), pool.num_idle())
        }
        DbBackend::MySql => {
            let pool = db.get_mysql_connection_pool();
            (pool.size(), pool.num_idle())
        }
        DbBackend::Sqlite => {
            let pool = db.get_sqlite_connection_pool();
            (pool.size(), pool.num_idle())
        }
        _ => (0, 0),
    };
    json!({
        "name": name,
        "url": spec.url.redacted(),
        "backend": format!("{backend:?}"),
        "reachable": reachable,
        "latency_ms": (latency_ms * 10.0).round() / 10.0,
        "server_version": version,
        "pool": { "open": size, "idle": idle },
        "error": error,
    })
}

/// The registered migrator's state on every database; not read while a
/// shard of `shards` is down (it reads every database).
async fn migrations(
    cluster: &Cluster,
    registry: &Registry,
    shards: &[Value],
    report: &mut Report,
) -> Value {
    let down: Vec<&str> = shards
        .iter()
        .filter(|s| s["reachable"] != true)
        .filter_map(|s| s["name"].as_str())
        .collect();
    match &registry.migrator {
        Some(_) if !down.is_empty() => {
            let reason = format!("not read: unreachable shards {}", down.join(", "));
            let _ = writeln!(report.text, "\nmigrations: {reason}");
            json!({ "skipped": reason })
        }
        Some(migrator) => match migrator.status(cluster).await {
            Ok(migrations) => {
                let behind = !migrations.is_current();
                report.problem |= behind;
                let _ = writeln!(
                    report.text,
                    "\nmigrations\n{}",
                    migration_table(&migrations)
                );
                migration_json(&migrations)
            }
            Err(err) => {
                report.problem = true;
                let _ = writeln!(report.text, "\nmigrations: {}", err.report());
                json!({ "error": err.report().to_string() })
            }
        },
        None => {
            let _ = writeln!(report.text, "\nmigrations: no migrator registered");
            Value::Null
        }
    }
}

/// Each group's placement and shards; a hash group's buckets per shard (a
/// movable group's from its live bucket map).
fn placements(cluster: &Cluster, report: &mut Report) -> Result<Vec<Value>> {
    let mut groups = Vec::new();
    let mut t = table(&["group", "placement", "shards", "buckets per shard"]);
    let topology = cluster.topology();
    for group in topology.group_names() {
        let shards: Vec<&str> = topology
            .scatter_shards(group)?
            .iter()
            .map(|id| topology.shard(*id).name.as_str())
            .collect();
        let (kind, buckets) = match topology.placement(group)? {
            Placement::Hash { buckets, owner } => {
                let owners = owner.to_vec();
                let per: Vec<(String, usize)> = topology
                    .scatter_shards(group)?
                    .iter()
                    .map(|id| {
                        (
                            topology.shard(*id).name.clone(),
                            owners.iter().filter(|o| *o == id).count(),
                        )
                    })
                    .collect();
                (format!("hash ({buckets} buckets)"), Some(per))
            }
            Placement::Range { .. } => ("range".to_owned(), None),
            Placement::Modulo { .. } => ("modulo".to_owned(), None),
            Placement::Directory { .. } => ("directory".to_owned(), None),
        };
        t.add_row(vec![
            group.to_owned(),
            kind.clone(),
            shards.join(", "),
            buckets
                .as_ref()
                .map(|b| {
                    b.iter()
                        .map(|(s, n)| format!("{s}: {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_else(|| "-".to_owned()),
        ]);
        groups.push(json!({
            "group": group,
            "placement": kind,
            "movable": topology.is_movable(group),
            "epoch": topology
                .live_owners(group)?
                .filter(|_| topology.is_movable(group))
                .map(|o| o.epoch()),
            "shards": shards,
            "buckets": buckets.map(|b| b
                .into_iter()
                .map(|(shard, n)| (shard, Value::from(n)))
                .collect::<serde_json::Map<String, Value>>()),
        }));
    }
    let _ = writeln!(
        report.text,
        "\nplacements (the configuration's, or a movable group's bucket map)\n{t}"
    );

    Ok(groups)
}

/// The state of every global index of the registered entities.
async fn indexes(cluster: &Cluster, registry: &Registry, report: &mut Report) -> Vec<Value> {
    let mut indexes = Vec::new();
    let mut t = table(&["table", "column", "unique", "state"]);
    for entity in &registry.entities {
        for (column, unique) in entity.indexes() {
            let state = match entity.index_state(cluster, column).await {
                Ok(state) => state.to_string(),
                Err(err) => {
                    report.problem = true;
                    format!("error: {}", err.report())
                }
            };
            t.add_row(vec![
                entity.table().to_owned(),
                column.to_owned(),
                unique.to_string(),
                state.clone(),
            ]);
            indexes.push(json!({
                "table": entity.table(), "column": column, "unique": unique, "state": state,
            }));
        }
    }
    if !indexes.is_empty() {
        let _ = writeln!(report.text, "\nglobal indexes\n{t}");
    }
    indexes
}

/// Every registered rollout's phase and instances.
async fn rollouts(cluster: &Cluster, registry: &Registry, report: &mut Report) -> Vec<Value> {
    let mut rollouts = Vec::new();
    for decl in &registry.rollouts {
        let (json, line) = match rollout_status(decl.register(cluster).await).await {
            Ok(pair) => pair,
            Err(err) => {
                report.problem = true;
                (
                    json!({ "name": decl.name(), "error": err.report().to_string() }),
                    format!("{}: {}\n", decl.name(), err.report()),
                )
            }
        };
        rollouts.push(json);
        let _ = write!(report.text, "\n{line}");
    }
    rollouts
}

/// Bucket moves not finished, of movable groups with registered entities.
async fn moves(cluster: &Cluster, registry: &Registry, report: &mut Report) -> Result<Vec<Value>> {
    let mut moves = Vec::new();
    let mut t = table(&MOVE_COLUMNS);
    for group in cluster.topology().movable_groups() {
        if !registry.entities.iter().any(|e| e.group() == group) {
            continue;
        }
        match moves_of(cluster, registry, group)?.list(false).await {
            Ok(list) => {
                for m in &list {
                    report.problem |= m.error.is_some() && !m.phase.is_finished();
                    t.add_row(move_row(m));
                    moves.push(move_json(m));
                }
            }
            Err(err) => {
                report.problem = true;
                moves.push(json!({ "group": group, "error": err.report().to_string() }));
                let _ = writeln!(report.text, "\nmoves of {group}: {}", err.report());
            }
        }
    }
    if !t.is_empty() {
        let _ = writeln!(report.text, "\nbucket moves\n{t}");
    }
    Ok(moves)
}

/// `status`'s connection budget: JSON and a table with its formula.
fn budget_status(budget: &ConnectionBudget) -> (Value, String) {
    let (main, side) = (budget.max_connections, budget.side_connections);
    let mut t = table(&[
        "server",
        "shards",
        "directories",
        "ticket servers",
        "connections",
    ]);
    for s in &budget.servers {
        t.add_row(vec![
            s.server.clone(),
            s.shards.to_string(),
            s.directories.to_string(),
            s.ticket_servers.to_string(),
            s.connections.to_string(),
        ]);
    }
    let text = format!(
        "connections one instance opens at most: {} (per server: shards x (max_connections {main} \
         + side_connections {side} + 1 probe) + (directories + ticket servers) x {main}; \
         times the number of instances)\n{t}",
        budget.total()
    );
    let json = json!({
        "total": budget.total(),
        "max_connections": main,
        "side_connections": side,
        "servers": budget.servers.iter().map(|s| json!({
            "server": s.server,
            "shards": s.shards,
            "directories": s.directories,
            "ticket_servers": s.ticket_servers,
            "connections": s.connections,
        })).collect::<Vec<_>>(),
    });
    (json, text)
}
