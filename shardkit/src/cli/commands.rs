//! What each command does, and what it prints.

use crate::cli::progress::Progress;
use crate::cli::registry::{AdminRollout, Registry};
use crate::cli::{
    Cli, Command, GsiAction, IdsAction, MigrateAction, Outcome, RebalanceAction, RolloutAction,
    VerifyAction,
};
use crate::error::{Result, ShardError};
use crate::topology::Placement;
use crate::topology::RangeBound;
use crate::{Cluster, ClusterConfig, MigrationReport, VerifyOptions, VerifyReport};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Where a `--bucket` the group does not have is reported: an error naming
/// it is a usage error ([`is_usage`]).
const USAGE_BUCKET: &str = "--bucket";

/// Whether `err` is about a command-line option's value (exit code 2, like
/// the errors of parsing the command line), not about the fleet.
pub(super) fn is_usage(err: &ShardError) -> bool {
    matches!(err, ShardError::Config { entry, .. } if entry == USAGE_BUCKET)
}

/// A read's plan for `--json`: the text `explain` prints (`plan`) and its
/// parts, each statement's SQL as the backend quotes its values.
fn plan_json(table: &str, plan: &crate::ReadPlan) -> Value {
    let route = match &plan.route {
        crate::PlannedRoute::Key { bucket } => json!({ "by": "key", "bucket": bucket }),
        crate::PlannedRoute::Keys { keys } => json!({ "by": "keys", "keys": keys }),
        crate::PlannedRoute::Scatter => json!({ "by": "scatter" }),
        crate::PlannedRoute::Index { index, keys } => {
            json!({ "by": "index", "index": index, "keys": keys })
        }
    };
    let merge = plan.merge.as_ref().map(|m| {
        json!({
            "order": m
                .order
                .iter()
                .map(|(column, desc)| json!({ "column": column, "desc": desc }))
                .collect::<Vec<_>>(),
            "limit": m.limit,
            "offset": m.offset,
        })
    });
    json!({
        "table": table,
        "plan": plan.to_string(),
        "route": route,
        "statements": plan
            .statements
            .iter()
            .map(|s| json!({ "shard": s.shard, "sql": s.sql }))
            .collect::<Vec<_>>(),
        "merge": merge,
        "partial": plan.partial,
        "timeout_ms": plan.timeout.map(|t| t.as_millis() as u64),
        "max_concurrency": plan.max_concurrency,
    })
}

/// How long `status` waits for one shard.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) async fn execute(
    cli: Cli,
    config: ClusterConfig,
    registry: Registry,
    _out: &mut (dyn std::io::Write + Send),
) -> Result<Outcome> {
    let json = cli.json;
    // Lazily: `status` must report a shard that is down, not fail on it;
    // every other command fails on the first statement it sends there.
    let mut config = config;
    // The application's budget: the same config, before `connect_lazy`.
    let budget = config.connection_budget()?;
    config.pool.connect_lazy = Some(true);
    let cluster = Cluster::connect(config).await?;
    match cli.command {
        Command::Status => status(&cluster, &registry, &budget).await,
        Command::Route { group, key } => route(&cluster, &registry, &group, &key).await,
        Command::Explain {
            table,
            keys,
            scatter: _,
        } => {
            let plan = registry
                .entity_named(&table)?
                .explain(&cluster, &keys)
                .await?;
            Ok(Outcome {
                json: plan_json(&table, &plan),
                text: format!("{plan}\n"),
                problem: false,
            })
        }
        Command::Migrate { action } => migrate(&cluster, &registry, action).await,
        Command::Gsi { action } => gsi(&cluster, &registry, action, json).await,
        Command::Rollout { action } => rollout(&cluster, &registry, action, json).await,
        Command::Verify {
            action:
                VerifyAction::Shards {
                    table,
                    source,
                    target,
                    bucket,
                    repair,
                },
        } => {
            let mut opts = VerifyOptions::default();
            if repair {
                opts = opts.repair();
            }
            let entity = registry.entity_named(&table)?;
            if let Some(bucket) = bucket {
                // A usage error (exit code 2), before anything is read.
                crate::verify::check_bucket(
                    cluster.topology(),
                    entity.group(),
                    bucket,
                    USAGE_BUCKET,
                )?;
            }
            let report = entity
                .verify_shards(&cluster, &source, &target, bucket, opts)
                .await?;
            Ok(verify_outcome(
                &format!("{table} on {source} → {target}"),
                &report,
            ))
        }
        Command::Ids { action } => ids(&cluster, action).await,
        Command::Rebalance { action } => rebalance(&cluster, &registry, action, json).await,
    }
}

/// Moves of `group`, with the registered entities of the group.
fn moves_of(
    cluster: &Cluster,
    registry: &Registry,
    group: &str,
) -> Result<crate::rebalance::Rebalance<crate::rebalance::AnyGroup>> {
    let entities: Vec<_> = registry
        .entities
        .iter()
        .filter(|e| e.group() == group)
        .collect();
    let Some(first) = entities.first() else {
        cluster.topology().placement(group)?;
        return Err(ShardError::Rebalance {
            group: group.to_owned(),
            id: None,
            reason: "no entity of the group is registered: add each with `Registry::entity`, parents before children".to_owned(),
        });
    };
    Ok(cluster.rebalance_named(first.group(), entities.iter().map(|e| e.mover()).collect()))
}

fn move_json(m: &crate::rebalance::MoveStatus) -> Value {
    json!({
        "id": m.id, "group": m.group, "target": m.target, "phase": m.phase.as_str(),
        "buckets": m.buckets.iter().map(|(b, s)| json!({ "bucket": b, "from": s })).collect::<Vec<_>>(),
        "rows_copied": m.rows_copied, "changes_applied": m.changes_applied,
        "pending_changes": m.pending_changes, "cutover_ms": m.cutover_ms, "error": m.error,
    })
}

fn move_row(m: &crate::rebalance::MoveStatus) -> Vec<String> {
    vec![
        m.id.to_string(),
        m.phase.to_string(),
        format!("{} → {}", m.buckets.len(), m.target),
        m.rows_copied.to_string(),
        m.pending_changes.to_string(),
        m.error.clone().unwrap_or_default(),
    ]
}

const MOVE_COLUMNS: [&str; 6] = [
    "move",
    "phase",
    "buckets",
    "rows copied",
    "pending",
    "error",
];

async fn rebalance(
    cluster: &Cluster,
    registry: &Registry,
    action: RebalanceAction,
    json: bool,
) -> Result<Outcome> {
    match action {
        RebalanceAction::Plan {
            group,
            to,
            buckets,
            range_at,
        } => {
            let moves = moves_of(cluster, registry, &group)?;
            let plan = plan_of(&moves, &to, buckets, range_at).await?;
            let mut from: std::collections::BTreeMap<&str, usize> = Default::default();
            for (_, s) in &plan.buckets {
                *from.entry(s.as_str()).or_default() += 1;
            }
            Ok(Outcome {
                json: json!({
                    "group": plan.group, "target": plan.target,
                    "buckets": plan.buckets.iter().map(|(b, s)| json!({ "bucket": b, "from": s })).collect::<Vec<_>>(),
                }),
                text: format!(
                    "{} buckets of {} to {}: {}\n",
                    plan.buckets.len(),
                    plan.group,
                    plan.target,
                    from.iter()
                        .map(|(s, n)| format!("{n} from {s}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                problem: false,
            })
        }
        RebalanceAction::Start {
            group,
            to,
            buckets,
            range_at,
        } => {
            let moves = moves_of(cluster, registry, &group)?;
            let plan = plan_of(&moves, &to, buckets, range_at).await?;
            let started = moves.start(&plan).await?;
            run_move(moves, started.id, json).await
        }
        RebalanceAction::Resume { group, id } => {
            run_move(moves_of(cluster, registry, &group)?, id, json).await
        }
        RebalanceAction::Abort { group, id } => {
            let done = moves_of(cluster, registry, &group)?.abort(id).await?;
            Ok(Outcome {
                json: move_json(&done),
                text: format!("move #{id}: {}; the sources own its buckets\n", done.phase),
                problem: false,
            })
        }
        RebalanceAction::Split { group, at } => {
            let moves = moves_of(cluster, registry, &group)?;
            let at = moves.bound_at(&at)?;
            let split = moves.split_at_bound(at).await?;
            let ranges = moves.ranges().await?;
            Ok(Outcome {
                json: json!({
                    "group": group,
                    "epoch": split.epoch,
                    "retired": range_json(cluster, &split.retired),
                    "left": range_json(cluster, &split.left),
                    "right": range_json(cluster, &split.right),
                    "ranges": ranges.iter().map(|r| range_json(cluster, r)).collect::<Vec<_>>(),
                }),
                text: format!(
                    "{group}: {} split into {} and {} on {} (map epoch {})\n",
                    split.retired,
                    split.left,
                    split.right,
                    cluster.topology().shard(split.left.shard).name,
                    split.epoch
                ),
                problem: false,
            })
        }
        RebalanceAction::Status { group, all } => {
            let moves = moves_of(cluster, registry, &group)?;
            let ranges = match cluster.topology().live_owners(&group)? {
                Some(crate::topology::LiveMap::Ranges(_)) => Some(moves.ranges().await?),
                _ => None,
            };
            let list = moves.list(all).await?;
            let epoch = cluster
                .topology()
                .live_owners(&group)?
                .map_or(0, |o| o.epoch());
            let mut t = table(&MOVE_COLUMNS);
            for m in &list {
                t.add_row(move_row(m));
            }
            let shown = ranges.as_ref().map_or(String::new(), |ranges| {
                ranges
                    .iter()
                    .map(|r| format!("  {r} on {}\n", cluster.topology().shard(r.shard).name))
                    .collect()
            });
            Ok(Outcome {
                json: json!({
                    "group": group,
                    "epoch": epoch,
                    "moves": list.iter().map(move_json).collect::<Vec<_>>(),
                    "ranges": ranges.map(|r| r.iter().map(|r| range_json(cluster, r)).collect::<Vec<_>>()),
                }),
                text: format!("{group}: bucket map epoch {epoch}\n{shown}{t}\n"),
                problem: list
                    .iter()
                    .any(|m| m.error.is_some() && !m.phase.is_finished()),
            })
        }
    }
}

/// The plan `plan` and `start` run: the given buckets, the range holding a
/// key, or an even-out plan.
async fn plan_of(
    moves: &crate::rebalance::Rebalance<crate::rebalance::AnyGroup>,
    to: &str,
    buckets: Vec<u32>,
    range_at: Option<String>,
) -> Result<crate::rebalance::MovePlan> {
    match range_at {
        Some(key) => {
            let at = moves.bound_at(&key)?;
            moves.plan_range_at(&at, to).await
        }
        None if buckets.is_empty() => moves.plan_even_out(to).await,
        None => moves.plan_buckets(buckets, to).await,
    }
}

fn range_json(cluster: &Cluster, r: &crate::topology::RangeUnit) -> serde_json::Value {
    let bound = |b: &Option<RangeBound>| match b {
        None => serde_json::Value::Null,
        Some(RangeBound::Int(v)) => json!(v),
        Some(RangeBound::Text(v)) => json!(v),
    };
    json!({
        "id": r.id,
        "from": bound(&r.from),
        "to": bound(&r.to),
        "shard": cluster.topology().shard(r.shard).name,
    })
}

/// Runs move `id` with a progress bar; Ctrl-C stops it at a chunk boundary.
async fn run_move(
    moves: crate::rebalance::Rebalance<crate::rebalance::AnyGroup>,
    id: i64,
    json: bool,
) -> Result<Outcome> {
    let progress = std::sync::Arc::new(std::sync::Mutex::new(Progress::new(
        format!("move #{id}"),
        None,
        json,
    )));
    let stop = progress
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .stop_flag();
    let shown = std::sync::Arc::clone(&progress);
    let moves = moves.stop_on(stop).on_progress(move |p| {
        let mut bar = shown.lock().unwrap_or_else(|p| p.into_inner());
        let _ = bar.report(
            p.rows_copied,
            Some(p.rows_estimated.max(p.rows_copied)),
            &format!(
                "{}: {:.0} rows/s, {} keys behind",
                p.phase, p.rows_per_sec, p.pending_changes
            ),
        );
    });
    let done = moves.run(id).await?;
    drop(progress);
    let text = if done.phase.is_finished() {
        format!(
            "move #{id}: {}, {} rows copied, {} keys replayed\n",
            done.phase, done.rows_copied, done.changes_applied
        )
    } else {
        format!(
            "move #{id}: stopped in {} (rebalance resume to go on)\n",
            done.phase
        )
    };
    Ok(Outcome {
        json: move_json(&done),
        text,
        problem: false,
    })
}

fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED);
    table.set_header(header.iter().copied());
    table
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

async fn status(
    cluster: &Cluster,
    registry: &Registry,
    budget: &crate::ConnectionBudget,
) -> Result<Outcome> {
    let mut problem = false;
    let mut text = String::new();

    // Shards.
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
        problem |= !reachable;
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
    let _ = writeln!(text, "shards\n{t}");

    // The connection budget: what one instance of this config may open.
    let (budget_json, budget_text) = budget_status(budget);
    let _ = writeln!(text, "\n{budget_text}");

    // Migrations (they read every database: skipped while one is down).
    let down: Vec<&str> = shards
        .iter()
        .filter(|s| s["reachable"] != true)
        .filter_map(|s| s["name"].as_str())
        .collect();
    let migrations = match &registry.migrator {
        Some(_) if !down.is_empty() => {
            let reason = format!("not read: unreachable shards {}", down.join(", "));
            let _ = writeln!(text, "\nmigrations: {reason}");
            json!({ "skipped": reason })
        }
        Some(migrator) => match migrator.status(cluster).await {
            Ok(report) => {
                let behind = !report.is_current();
                problem |= behind;
                let _ = writeln!(text, "\nmigrations\n{}", migration_table(&report));
                migration_json(&report)
            }
            Err(err) => {
                problem = true;
                let _ = writeln!(text, "\nmigrations: {}", err.report());
                json!({ "error": err.report().to_string() })
            }
        },
        None => {
            let _ = writeln!(text, "\nmigrations: no migrator registered");
            Value::Null
        }
    };

    // Placements.
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
        text,
        "\nplacements (the configuration's, or a movable group's bucket map)\n{t}"
    );

    // Indexes.
    let mut indexes = Vec::new();
    let mut t = table(&["table", "column", "unique", "state"]);
    for entity in &registry.entities {
        for (column, unique) in entity.indexes() {
            let state = match entity.index_state(cluster, column).await {
                Ok(state) => state.to_string(),
                Err(err) => {
                    problem = true;
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
        let _ = writeln!(text, "\nglobal indexes\n{t}");
    }

    // Rollouts.
    let mut rollouts = Vec::new();
    for decl in &registry.rollouts {
        let (json, line) = match rollout_status(cluster, decl.register(cluster).await).await {
            Ok(pair) => pair,
            Err(err) => {
                problem = true;
                (
                    json!({ "name": decl.name(), "error": err.report().to_string() }),
                    format!("{}: {}\n", decl.name(), err.report()),
                )
            }
        };
        rollouts.push(json);
        let _ = write!(text, "\n{line}");
    }
    // Bucket moves not finished, of movable groups with registered entities.
    let mut moves = Vec::new();
    let mut t = table(&MOVE_COLUMNS);
    for group in topology.movable_groups() {
        if !registry.entities.iter().any(|e| e.group() == group) {
            continue;
        }
        match moves_of(cluster, registry, group)?.list(false).await {
            Ok(list) => {
                for m in &list {
                    problem |= m.error.is_some() && !m.phase.is_finished();
                    t.add_row(move_row(m));
                    moves.push(move_json(m));
                }
            }
            Err(err) => {
                problem = true;
                moves.push(json!({ "group": group, "error": err.report().to_string() }));
                let _ = writeln!(text, "\nmoves of {group}: {}", err.report());
            }
        }
    }
    if !t.is_empty() {
        let _ = writeln!(text, "\nbucket moves\n{t}");
    }
    Ok(Outcome {
        json: json!({
            "shards": shards,
            "connection_budget": budget_json,
            "migrations": migrations,
            "groups": groups,
            "indexes": indexes,
            "rollouts": rollouts,
            "moves": moves,
        }),
        text,
        problem,
    })
}

/// `status`'s connection budget: JSON and a table with its formula.
fn budget_status(budget: &crate::ConnectionBudget) -> (Value, String) {
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

async fn rollout_status(
    _cluster: &Cluster,
    handle: Result<Box<dyn AdminRollout>>,
) -> Result<(Value, String)> {
    let status = handle?.status().await?;
    let mut t = table(&["instance", "cache ttl", "refresh", "last seen (ms)"]);
    let instances: Vec<Value> = status
        .instances
        .iter()
        .map(|i| {
            t.add_row(vec![
                i.name.clone(),
                format!("{:?}", i.cache_ttl),
                format!("{:?}", i.refresh_every),
                i.seen_ms.to_string(),
            ]);
            json!({
                "name": i.name,
                "cache_ttl_ms": i.cache_ttl.as_millis() as u64,
                "refresh_ms": i.refresh_every.as_millis() as u64,
                "seen_ms": i.seen_ms,
                "this_instance": i.this_instance,
            })
        })
        .collect();
    let text = format!(
        "rollout {}: phase {}, gap {:?}, backfilled {}\n{t}\n",
        status.name, status.phase, status.gap, status.backfilled
    );
    Ok((
        json!({
            "name": status.name,
            "phase": status.phase.to_string(),
            "changed_ms": status.changed_ms,
            "gap_ms": status.gap.as_millis() as u64,
            "backfilled": status.backfilled,
            "instances": instances,
        }),
        text,
    ))
}

fn migration_json(report: &MigrationReport) -> Value {
    let behind: Vec<&str> = report.behind().iter().map(|d| d.name.as_str()).collect();
    json!({
        "current": report.is_current(),
        "databases": report.databases.iter().map(|d| json!({
            "name": d.name,
            "applied": d.applied,
            "pending": d.pending,
            "behind": behind.contains(&d.name.as_str()),
        })).collect::<Vec<_>>(),
    })
}

fn migration_table(report: &MigrationReport) -> Table {
    let mut t = table(&["database", "applied", "pending", "drift"]);
    for d in &report.databases {
        t.add_row(vec![
            d.name.clone(),
            d.applied.len().to_string(),
            if d.pending.is_empty() {
                "0".to_owned()
            } else {
                format!("{} ({})", d.pending.len(), d.pending.join(", "))
            },
            if d.pending.is_empty() {
                String::new()
            } else {
                "BEHIND".to_owned()
            },
        ]);
    }
    t
}

async fn route(cluster: &Cluster, registry: &Registry, group: &str, key: &str) -> Result<Outcome> {
    let entity = registry
        .entities
        .iter()
        .find(|e| e.group() == group)
        .ok_or_else(|| {
            ShardError::config(
                "shardctl",
                format!(
                    "no registered entity belongs to group `{group}`, so its key type is \
                     unknown here; register one with Registry::entity"
                ),
            )
        })?;
    let target = entity.route(cluster, key).await?;
    let spec = cluster.topology().shard(target.shard);
    let host = spec
        .host
        .clone()
        .or_else(|| spec.url.host())
        .unwrap_or_else(|| "-".to_owned());
    Ok(Outcome {
        json: json!({
            "group": group,
            "key": key,
            "bucket": target.bucket,
            "shard": spec.name,
            "host": host,
            "url": spec.url.redacted(),
        }),
        text: format!(
            "{group} {key}: bucket {}, shard {} on {host} ({})\n",
            target
                .bucket
                .map_or_else(|| "-".to_owned(), |b| b.to_string()),
            spec.name,
            spec.url.redacted()
        ),
        problem: false,
    })
}

async fn migrate(cluster: &Cluster, registry: &Registry, action: MigrateAction) -> Result<Outcome> {
    let migrator = registry.migrator.as_ref().ok_or_else(|| {
        ShardError::config(
            "shardctl",
            "no migrator registered; add one with Registry::migrator::<Migrator>()",
        )
    })?;
    let report = match action {
        MigrateAction::Up => migrator.up(cluster).await?,
        MigrateAction::Status => migrator.status(cluster).await?,
    };
    Ok(Outcome {
        json: migration_json(&report),
        text: format!("{}\n", migration_table(&report)),
        problem: !report.is_current(),
    })
}

async fn gsi(
    cluster: &Cluster,
    registry: &Registry,
    action: GsiAction,
    json: bool,
) -> Result<Outcome> {
    let pick = |table: &Option<String>| -> Result<Vec<&dyn super::registry::AdminEntity>> {
        match table {
            Some(table) => Ok(vec![registry.entity_named(table)?]),
            None => Ok(registry
                .entities
                .iter()
                .filter(|e| !e.indexes().is_empty())
                .map(|e| &**e)
                .collect()),
        }
    };
    match action {
        GsiAction::Status => {
            let mut rows = Vec::new();
            let mut t = table(&["table", "column", "unique", "state"]);
            for entity in pick(&None)? {
                for (column, unique) in entity.indexes() {
                    let state = entity.index_state(cluster, column).await?.to_string();
                    t.add_row(vec![
                        entity.table().to_owned(),
                        column.to_owned(),
                        unique.to_string(),
                        state.clone(),
                    ]);
                    rows.push(json!({ "table": entity.table(), "column": column, "unique": unique, "state": state }));
                }
            }
            let text = if rows.is_empty() {
                "no registered entity has a global index\n".to_owned()
            } else {
                format!("{t}\n")
            };
            Ok(Outcome {
                json: Value::Array(rows),
                text,
                problem: false,
            })
        }
        GsiAction::Create { table } => {
            let mut created = Vec::new();
            for entity in pick(&table)? {
                entity.index_create(cluster).await?;
                created.push(entity.table());
            }
            Ok(Outcome {
                text: format!(
                    "index tables and catalog rows ready for: {}\n",
                    created.join(", ")
                ),
                json: json!({ "created": created }),
                problem: false,
            })
        }
        GsiAction::Backfill {
            table,
            column,
            chunk,
        } => {
            let entity = registry.entity_named(&table)?;
            let columns: Vec<&str> = match &column {
                Some(c) => vec![c.as_str()],
                None => entity.indexes().into_iter().map(|(c, _)| c).collect(),
            };
            let mut results = Vec::new();
            let mut text = String::new();
            let mut stopped = false;
            for column in columns {
                let mut progress =
                    Progress::new(format!("gsi backfill {table}.{column}"), None, json);
                let mut on_progress = |p: crate::gsi::BackfillProgress| {
                    let rate = progress.rate(p.rows);
                    progress.report(
                        p.shards_done as u64,
                        Some(p.shards as u64),
                        &format!(
                            "shards, {} rows, {} index rows, {rate:.0} rows/s",
                            p.rows, p.written
                        ),
                    )
                };
                let done = entity
                    .index_backfill(cluster, column, chunk, &mut on_progress)
                    .await?;
                stopped |= progress.stopped() && !done.finished;
                let _ = writeln!(
                    text,
                    "{table}.{column}: {} rows read, {} index rows written, {}",
                    done.rows,
                    done.written,
                    if done.finished {
                        "active"
                    } else {
                        "stopped (run again to resume)"
                    }
                );
                results.push(json!({
                    "table": table, "column": column, "rows": done.rows,
                    "written": done.written, "finished": done.finished,
                }));
                if stopped {
                    break;
                }
            }
            Ok(Outcome {
                json: Value::Array(results),
                text,
                problem: stopped,
            })
        }
        GsiAction::Reconcile { table } => {
            let mut results = Vec::new();
            let mut text = String::new();
            let mut problem = false;
            for entity in pick(&table)? {
                let r = entity.index_reconcile(cluster).await?;
                problem |= !r.conflicts.is_empty();
                let _ = writeln!(
                    text,
                    "{}: {} index rows scanned, {} dangling removed, {} missing added, {} conflicts",
                    entity.table(),
                    r.scanned,
                    r.removed,
                    r.added,
                    r.conflicts.len()
                );
                results.push(json!({
                    "table": entity.table(), "scanned": r.scanned, "removed": r.removed,
                    "added": r.added, "conflicts": r.conflicts.len(),
                }));
            }
            Ok(Outcome {
                json: Value::Array(results),
                text,
                problem,
            })
        }
    }
}

async fn rollout(
    cluster: &Cluster,
    registry: &Registry,
    action: RolloutAction,
    json: bool,
) -> Result<Outcome> {
    let named = |name: &str| {
        registry
            .rollouts
            .iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                ShardError::config(
                    "shardctl",
                    format!(
                        "no registered rollout is named `{name}` (registered: {}); add it with \
                         Registry::rollout",
                        registry
                            .rollouts
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    };
    match action {
        RolloutAction::Status { name } => {
            let mut all = Vec::new();
            let mut text = String::new();
            for decl in &registry.rollouts {
                if name.as_deref().is_some_and(|n| n != decl.name()) {
                    continue;
                }
                let (j, t) = rollout_status(cluster, decl.register(cluster).await).await?;
                all.push(j);
                text.push_str(&t);
            }
            if let Some(name) = name.filter(|_| all.is_empty()) {
                named(&name)?;
            }
            Ok(Outcome {
                json: Value::Array(all),
                text,
                problem: false,
            })
        }
        RolloutAction::Advance { name } => {
            let handle = named(&name)?.register(cluster).await?;
            let mut progress = Progress::new(format!("rollout {name} advance"), None, json);
            let mut on_wait = |next: crate::Phase, left: Duration| {
                let _ = progress.report(
                    0,
                    None,
                    &format!("to {next}: waiting {left:.0?} for the gap"),
                );
            };
            let phase = handle.advance(&mut on_wait).await?;
            Ok(Outcome {
                json: json!({ "name": name, "phase": phase.to_string() }),
                text: format!("rollout {name}: now {phase}\n"),
                problem: false,
            })
        }
        RolloutAction::Retreat { name } => {
            let handle = named(&name)?.register(cluster).await?;
            let phase = handle.retreat().await?;
            Ok(Outcome {
                json: json!({ "name": name, "phase": phase.to_string() }),
                text: format!("rollout {name}: now {phase}\n"),
                problem: false,
            })
        }
        RolloutAction::Backfill { name, chunk } => {
            let handle = named(&name)?.register(cluster).await?;
            let mut progress = Progress::new(format!("rollout {name} backfill"), None, json);
            let mut on_progress = |p: crate::RolloutBackfill| {
                let rate = progress.rate(p.rows);
                progress.report(
                    p.shards_done as u64,
                    Some(p.shards as u64),
                    &format!("shards, {} rows, {rate:.0} rows/s", p.rows),
                )
            };
            // Right after the move to dual_write the backfill must wait out
            // the gap; an operator's command waits instead of failing.
            let done = match handle.backfill(chunk, &mut on_progress).await {
                Err(ShardError::RolloutTooSoon { wait_ms, .. }) => {
                    if !json {
                        eprintln!(
                            "rollout {name}: waiting {wait_ms} ms for the gap after dual_write began"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                    handle.backfill(chunk, &mut on_progress).await?
                }
                other => other?,
            };
            Ok(Outcome {
                json: json!({
                    "name": name, "rows": done.rows, "shards_done": done.shards_done,
                    "shards": done.shards, "finished": done.finished,
                }),
                text: format!(
                    "rollout {name}: {} rows copied, {}/{} shards, {}\n",
                    done.rows,
                    done.shards_done,
                    done.shards,
                    if done.finished {
                        "finished"
                    } else {
                        "stopped (run again to resume)"
                    }
                ),
                problem: !done.finished,
            })
        }
        RolloutAction::Verify {
            name,
            repair,
            resume,
            chunk,
        } => {
            let handle = named(&name)?.register(cluster).await?;
            let mut opts = VerifyOptions::default().chunk(chunk);
            if repair {
                opts = opts.repair();
            }
            if resume {
                opts = opts.resume();
            }
            let mut progress = Progress::new(format!("rollout {name} verify"), None, json);
            let mut on_progress = |r: &VerifyReport| {
                let rate = progress.rate(r.rows);
                progress.report(
                    r.chunks,
                    None,
                    &format!(
                        "chunks, {} rows, {} differences, {rate:.0} rows/s",
                        r.rows,
                        r.differences()
                    ),
                )
            };
            let report = handle.verify(opts, &mut on_progress).await?;
            Ok(verify_outcome(&format!("rollout {name}"), &report))
        }
    }
}

fn verify_outcome(what: &str, report: &VerifyReport) -> Outcome {
    let list = |diffs: &[crate::RowDiff]| -> Vec<Value> {
        diffs
            .iter()
            .map(|d| json!({ "shard": d.shard, "pk": d.pk }))
            .collect()
    };
    let mut text = format!(
        "{what}: {} rows in {} chunks; {} missing, {} extra, {} different, {} repaired{}\n",
        report.rows,
        report.chunks,
        report.missing.len(),
        report.extra.len(),
        report.different.len(),
        report.repaired,
        if report.finished {
            String::new()
        } else {
            format!(
                " (stopped at {}; run again with --resume)",
                report.cursor.as_deref().unwrap_or("-")
            )
        }
    );
    for (kind, diffs) in [
        ("missing", &report.missing),
        ("extra", &report.extra),
        ("different", &report.different),
    ] {
        for d in diffs.iter().take(20) {
            let _ = writeln!(text, "  {kind}: {} on {}", d.pk, d.shard);
        }
    }
    Outcome {
        json: json!({
            "rows": report.rows,
            "chunks": report.chunks,
            "missing": list(&report.missing),
            "extra": list(&report.extra),
            "different": list(&report.different),
            "repaired": report.repaired,
            "finished": report.finished,
            "cursor": report.cursor,
        }),
        text,
        problem: !report.is_consistent() && report.repaired == 0 || !report.finished,
    }
}

async fn ids(cluster: &Cluster, action: IdsAction) -> Result<Outcome> {
    match action {
        IdsAction::Next { sequence } => {
            let id = cluster.ids().next(&sequence).await?;
            Ok(Outcome {
                json: json!({ "sequence": sequence, "id": id }),
                text: format!("{id}\n"),
                problem: false,
            })
        }
        IdsAction::Status => {
            let servers: Vec<&str> = cluster.ids().servers().collect();
            let sequences = if servers.is_empty() {
                Ok(Vec::new())
            } else {
                cluster.ids().sequences().await
            };
            let places = cluster.ids().places().await;
            let mut text = format!(
                "ticket servers: {}\nsequences: {}\n",
                if servers.is_empty() {
                    "none configured".to_owned()
                } else {
                    servers.join(", ")
                },
                match &sequences {
                    Ok(names) if names.is_empty() => "none".to_owned(),
                    Ok(names) => names.join(", "),
                    Err(err) => format!("unknown ({})", err.report()),
                }
            );
            let mut rows = Vec::new();
            for server in &places {
                let (state, row) = match &server.recorded {
                    Err(err) => (
                        format!("unreachable: {}", err.report()),
                        json!({ "error": err.report().to_string() }),
                    ),
                    Ok(None) => ("no place recorded".to_owned(), json!({})),
                    Ok(Some(place)) => (
                        format!(
                            "server {} of {} {}, {}",
                            place.position,
                            place.servers.len(),
                            serde_json::to_string(&place.servers).unwrap_or_default(),
                            if place.confirmed {
                                "confirmed"
                            } else {
                                "unconfirmed"
                            }
                        ),
                        json!({
                            "position": place.position,
                            "list": place.servers,
                            "confirmed": place.confirmed,
                        }),
                    ),
                };
                let serves = if server.serves {
                    "serves"
                } else {
                    "SERVES NO TICKET"
                };
                text.push_str(&format!("  {}: {state} ({serves})\n", server.name));
                let mut row = row;
                row["name"] = json!(server.name);
                row["serves"] = json!(server.serves);
                rows.push(row);
            }
            Ok(Outcome {
                text,
                json: json!({
                    "servers": servers,
                    "sequences": sequences.as_ref().ok(),
                    "places": rows,
                }),
                problem: sequences.is_err() || places.iter().any(|p| !p.serves),
            })
        }
        IdsAction::AdoptPlaces => {
            cluster.ids().adopt_places().await?;
            let servers: Vec<&str> = cluster.ids().servers().collect();
            Ok(Outcome {
                text: format!("ticket servers' places recorded: {}\n", servers.join(", ")),
                json: json!({ "recorded": servers }),
                problem: false,
            })
        }
        IdsAction::ClearUnconfirmedPlaces => {
            let removed = cluster.ids().clear_unconfirmed_places().await?;
            Ok(Outcome {
                text: format!("unconfirmed places removed: {removed}\n"),
                json: json!({ "removed": removed }),
                problem: false,
            })
        }
    }
}
