//! The operator's command line (`shardkit::cli`), run in-process against
//! SQLite, PostgreSQL and MySQL/MariaDB shards: each command's `--json`
//! output and exit code, against what the databases hold.

use sea_orm::{ConnectionTrait, EntityTrait};
use serde_json::Value;
use shardkit::cli::Registry;
use shardkit::{Cluster, ClusterConfig, Rollout};
use shardkit_tests::models::*;
use shardkit_tests::{Backend, Hung, TestDbs, backend_tests};
use std::time::Duration;

backend_tests!(2 =>
    status_reports_shards_migrations_placements_indexes_and_rollouts,
    [Postgres, MySql] status_marks_a_refusing_and_a_hung_shard,
    route_explain_and_errors,
    gsi_commands_create_backfill_and_reconcile,
    rollout_commands_walk_backfill_and_verify,
    verify_shards_compares_one_bucket,
    ids_commands_adopt_and_clear_ticket_places,
    explain_of_hostile_keys_is_escaped_text_and_valid_json,
    json_output_is_json_for_usage_errors_and_help,
);

fn registry() -> Registry {
    Registry::new()
        .migrator::<Migrator>()
        .entity::<customer::Entity>()
        .entity::<contact::Entity>()
        .rollout(
            Rollout::<person_v1::Entity, person_v2::Entity>::new("people_v2", person_to_v2)
                .to_old(person_to_v1)
                .cache_ttl(Duration::from_millis(30))
                .refresh_interval(Duration::from_millis(20)),
        )
}

fn config(dbs: &TestDbs) -> ClusterConfig {
    dbs.config(2, "[groups.Customer]\nbuckets = 64\n")
}

/// Runs `shardctl <args>` with `--json`; its exit code and parsed output.
async fn shardctl(config: ClusterConfig, args: &[&str]) -> (u8, Value) {
    let mut out: Vec<u8> = Vec::new();
    let argv = ["shardctl", "--json"].iter().chain(args).copied();
    let code = shardkit::cli::run_with(argv, config, registry(), &mut out).await;
    let text = String::from_utf8(out).unwrap();
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("shardctl {args:?}: not JSON ({e}): {text}"));
    (code, value)
}

/// The same without `--json`: exit code and text.
async fn shardctl_text(config: ClusterConfig, args: &[&str]) -> (u8, String) {
    let mut out: Vec<u8> = Vec::new();
    let argv = ["shardctl"].iter().chain(args).copied();
    let code = shardkit::cli::run_with(argv, config, registry(), &mut out).await;
    (code, String::from_utf8(out).unwrap())
}

async fn status_reports_shards_migrations_placements_indexes_and_rollouts(dbs: &mut TestDbs) {
    // Nothing migrated yet: every database is behind, and status says so
    // with exit code 1.
    let (code, status) = shardctl(config(dbs), &["status"]).await;
    assert_eq!(code, 1, "{status:#}");
    assert_eq!(status["migrations"]["current"], false);
    // A database error says what failed, where, and the driver's message,
    // once, in JSON and in text.
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    let url = cluster.topology().shards()[0].url.redacted();
    let database = url.rsplit('/').next().unwrap().to_owned();
    drop(cluster);
    let driver = match dbs.backend {
        Backend::Sqlite => "(code: 1) no such table: shardkit_rollouts".to_owned(),
        Backend::Postgres => {
            "relation \"shardkit_rollouts\" does not exist (SQLSTATE 42P01)".to_owned()
        }
        Backend::MySql => {
            format!("1146 (42S02): Table '{database}.shardkit_rollouts' doesn't exist")
        }
    };
    let message = format!(
        "read shardkit_rollouts on `s0` (rollout table `shardkit_rollouts`) failed: {driver}"
    );
    assert_eq!(status["rollouts"][0]["error"], message.as_str());
    let (code, text) = shardctl_text(config(dbs), &["rollout", "status", "people_v2"]).await;
    assert_eq!(code, 1, "{text}");
    assert_eq!(text, format!("error: {message}\n"));
    let (code, json) = shardctl(config(dbs), &["rollout", "status", "people_v2"]).await;
    assert_eq!(code, 1, "{json}");
    assert_eq!(json, serde_json::json!({ "error": message }));
    // What one instance of this config opens at most: per shard its pool
    // (4), its side pool (2) and, on a server, the breaker's probe.
    let (server, probe) = match dbs.backend {
        Backend::Sqlite => ("sqlite".to_owned(), 0),
        backend => (backend.server_address().unwrap(), 1),
    };
    assert_eq!(
        status["connection_budget"],
        serde_json::json!({
            "total": 2 * (4 + 2 + probe),
            "max_connections": 4,
            "side_connections": 2,
            "servers": [{
                "server": server,
                "shards": 2,
                "directories": 0,
                "ticket_servers": 0,
                "connections": 2 * (4 + 2 + probe),
            }],
        })
    );
    assert!(
        status["migrations"]["databases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["behind"] == true && !d["pending"].as_array().unwrap().is_empty())
    );
    let (code, up) = shardctl(config(dbs), &["migrate", "up"]).await;
    assert_eq!(code, 0, "{up:#}");
    assert_eq!(up["current"], true);

    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    cluster
        .setup::<(contact::Entity, person_v1::Entity)>()
        .await
        .unwrap();
    let (code, status) = shardctl(config(dbs), &["status"]).await;
    assert_eq!(code, 0, "{status:#}");
    let shards = status["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2);
    for shard in shards {
        assert_eq!(shard["reachable"], true, "{shard:#}");
        assert!(
            shard["server_version"]
                .as_str()
                .is_some_and(|v| !v.is_empty())
        );
        // The URL is shown without its password.
        assert!(!shard["url"].as_str().unwrap().contains("secret"));
    }
    assert_eq!(status["migrations"]["current"], true);
    let group = &status["groups"][0];
    assert_eq!(group["group"], "Customer");
    let buckets: u64 = group["buckets"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(buckets, 64);
    let indexes = status["indexes"].as_array().unwrap();
    assert_eq!(
        indexes
            .iter()
            .map(|i| (i["table"].as_str().unwrap(), i["column"].as_str().unwrap()))
            .collect::<Vec<_>>(),
        [("contacts", "email"), ("contacts", "phone")]
    );
    let rollout = &status["rollouts"][0];
    assert_eq!(rollout["name"], "people_v2");
    assert_eq!(rollout["phase"], "off");
    assert!(
        rollout["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["name"] == "shardctl")
    );
    // And for a reader: tables, with every shard named.
    let (code, text) = shardctl_text(config(dbs), &["status"]).await;
    assert_eq!(code, 0);
    assert!(
        text.contains("s0") && text.contains("s1") && text.contains("people_v2"),
        "{text}"
    );
}

/// A shard that refuses connections and one that accepts and never answers
/// are both reported unreachable (the second after the probe's timeout),
/// with exit code 1; the reachable one is reported as it is, and nothing
/// stays connected to the hung server.
async fn status_marks_a_refusing_and_a_hung_shard(dbs: &mut TestDbs) {
    let (code, _) = shardctl(config(dbs), &["migrate", "up"]).await;
    assert_eq!(code, 0);
    let hung = Hung::start().await;
    let good = dbs.shards_toml(1);
    // Port 9 (discard) refuses connections.
    let refusing = match dbs.backend {
        Backend::MySql => "mysql://root@127.0.0.1:9/down",
        _ => "postgres://postgres@127.0.0.1:9/down",
    };
    let toml = format!(
        "{good}[[shards]]\nname = \"refusing\"\nurl = \"{refusing}\"\n\n[[shards]]\nname = \"hung\"\nurl = \"{}\"\n\n[groups.Customer]\nshards = [\"s0\"]\n",
        hung.url(dbs.backend)
    );
    let config = ClusterConfig::from_toml(&toml).unwrap();
    let started = std::time::Instant::now();
    let (code, status) = shardctl(config, &["status"]).await;
    assert_eq!(code, 1, "{status:#}");
    // The probes run at once, each bounded by the 5 s connect timeout, and
    // nothing else waits on the shards that are down.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let by_name = |name: &str| {
        status["shards"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap()
            .clone()
    };
    assert_eq!(by_name("s0")["reachable"], true);
    assert_eq!(by_name("refusing")["reachable"], false);
    assert_eq!(by_name("hung")["reachable"], false);
    assert!(
        by_name("hung")["error"]
            .as_str()
            .unwrap()
            .contains("within")
    );
    assert!(
        by_name("refusing")["error"]
            .as_str()
            .unwrap()
            .contains("refused")
    );
    assert!(
        status["migrations"]["skipped"]
            .as_str()
            .unwrap()
            .contains("hung")
    );
    // The command's cluster is gone: the hung server's sockets are closed.
    for _ in 0..200 {
        if hung.open() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(hung.open(), 0, "sockets left open to the hung server");
}

async fn route_explain_and_errors(dbs: &mut TestDbs) {
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    for key in [7_i64, 8, 1_000] {
        let (code, route) = shardctl(config(dbs), &["route", "Customer", &key.to_string()]).await;
        assert_eq!(code, 0, "{route:#}");
        let target = cluster.route::<Customer>(&key).await.unwrap();
        assert_eq!(
            route["shard"],
            cluster.shard_of::<Customer>(&key).await.unwrap()
        );
        assert_eq!(route["bucket"], target.bucket.unwrap());
    }
    let (code, plan) = shardctl(config(dbs), &["explain", "contacts", "--key", "7"]).await;
    assert_eq!(code, 0, "{plan:#}");
    assert!(
        plan["plan"].as_str().unwrap().contains("contacts"),
        "{plan:#}"
    );
    let (code, plan) = shardctl(config(dbs), &["explain", "contacts", "--scatter"]).await;
    assert_eq!(code, 0);
    assert!(plan["plan"].as_str().unwrap().contains("s0"), "{plan:#}");
    // Bad input: each error names what is wrong.
    let (code, err) = shardctl(config(dbs), &["route", "Customer", "seven"]).await;
    assert_eq!(code, 1);
    assert!(err["error"].as_str().unwrap().contains("`seven`"), "{err}");
    let (code, err) = shardctl(config(dbs), &["explain", "nope", "--key", "1"]).await;
    assert_eq!(code, 1);
    let message = err["error"].as_str().unwrap();
    assert!(
        message.contains("`nope`") && message.contains("contacts"),
        "{message}"
    );
    let (code, err) = shardctl(config(dbs), &["route", "Tenant", "x"]).await;
    assert_eq!(code, 1);
    assert!(err["error"].as_str().unwrap().contains("Tenant"), "{err}");
    let (code, usage) = shardctl_text(config(dbs), &["route"]).await;
    assert_eq!(code, 2, "{usage}");
    assert!(usage.contains("<GROUP>"), "{usage}");
}

async fn gsi_commands_create_backfill_and_reconcile(dbs: &mut TestDbs) {
    let (code, _) = shardctl(config(dbs), &["migrate", "up"]).await;
    assert_eq!(code, 0);
    let (code, created) = shardctl(config(dbs), &["gsi", "create"]).await;
    assert_eq!(code, 0, "{created:#}");
    assert_eq!(created["created"], serde_json::json!(["contacts"]));
    // Rows written straight into the shards, around shardkit: the index
    // knows nothing of them until the backfill.
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    for id in 1..=30_i64 {
        let row = contact::row(id, id % 5, &format!("c{id}@x"), "555");
        let shard = cluster.shard_of::<Customer>(&(id % 5)).await.unwrap();
        contact::Entity::insert(row)
            .exec_without_returning(cluster.connection(shard).unwrap())
            .await
            .unwrap();
    }
    let (code, done) = shardctl(config(dbs), &["gsi", "backfill", "contacts", "email"]).await;
    assert_eq!(code, 0, "{done:#}");
    assert_eq!(done[0]["rows"], 30);
    assert_eq!(done[0]["finished"], true);
    let (code, states) = shardctl(config(dbs), &["gsi", "status"]).await;
    assert_eq!(code, 0);
    let state = |column: &str| {
        states
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["column"] == column)
            .unwrap()["state"]
            .clone()
    };
    assert_eq!(state("email"), "active");
    assert_eq!(state("phone"), "write_only");
    let found = cluster
        .find::<contact::Entity>()
        .by_index(contact::Column::Email, "c17@x")
        .all()
        .await
        .unwrap();
    assert_eq!(found.iter().map(|c| c.id).collect::<Vec<_>>(), [17]);
    // A row written around shardkit after the backfill has no index row:
    // reconcile adds it.
    let shard = cluster.shard_of::<Customer>(&2).await.unwrap();
    contact::Entity::insert(contact::row(31, 2, "late@x", "555"))
        .exec_without_returning(cluster.connection(shard).unwrap())
        .await
        .unwrap();
    let late = || {
        cluster
            .find::<contact::Entity>()
            .by_index(contact::Column::Email, "late@x")
            .all()
    };
    assert!(late().await.unwrap().is_empty());
    let (code, reconciled) = shardctl(config(dbs), &["gsi", "reconcile", "contacts"]).await;
    assert_eq!(code, 0, "{reconciled:#}");
    assert!(
        reconciled[0]["added"].as_u64().unwrap() >= 1,
        "{reconciled:#}"
    );
    assert_eq!(
        late()
            .await
            .unwrap()
            .iter()
            .map(|c| c.id)
            .collect::<Vec<_>>(),
        [31]
    );
    let (code, err) = shardctl(config(dbs), &["gsi", "backfill", "contacts", "name"]).await;
    assert_eq!(code, 1);
    assert!(err["error"].as_str().unwrap().contains("email"), "{err}");
}

async fn rollout_commands_walk_backfill_and_verify(dbs: &mut TestDbs) {
    let (code, _) = shardctl(config(dbs), &["migrate", "up"]).await;
    assert_eq!(code, 0);
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    for id in 1..=12_i64 {
        let tx = cluster.begin::<Customer>(id % 4).await.unwrap();
        tx.insert(sea_orm::IntoActiveModel::into_active_model(
            person_v1::Model {
                id,
                customer_id: id % 4,
                first_name: "A".into(),
                last_name: format!("L{id}"),
                city: "Oslo".into(),
            },
        ))
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    for phase in ["cache_both", "dual_write"] {
        let (code, moved) = shardctl(config(dbs), &["rollout", "advance", "people_v2"]).await;
        assert_eq!(code, 0, "{moved:#}");
        assert_eq!(moved["phase"], phase);
    }
    let (code, done) = shardctl(
        config(dbs),
        &["rollout", "backfill", "people_v2", "--chunk", "5"],
    )
    .await;
    assert_eq!(code, 0, "{done:#}");
    assert_eq!(done["rows"], 12);
    assert_eq!(done["finished"], true);
    let (code, report) = shardctl(config(dbs), &["rollout", "verify", "people_v2"]).await;
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["rows"], 12);
    // A new row lost around shardkit: verify finds it (exit 1), repair
    // puts it back.
    let shard = cluster.shard_of::<Customer>(&3).await.unwrap();
    cluster
        .connection(shard)
        .unwrap()
        .execute_unprepared("DELETE FROM people_v2 WHERE id = 7")
        .await
        .unwrap();
    let (code, report) = shardctl(config(dbs), &["rollout", "verify", "people_v2"]).await;
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(report["missing"][0]["pk"], "7");
    let (code, report) =
        shardctl(config(dbs), &["rollout", "verify", "people_v2", "--repair"]).await;
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["repaired"], 1);
    let (code, status) = shardctl(config(dbs), &["rollout", "status", "people_v2"]).await;
    assert_eq!(code, 0);
    assert_eq!(status[0]["phase"], "dual_write");
    assert_eq!(status[0]["backfilled"], true);
    let (code, back) = shardctl(config(dbs), &["rollout", "retreat", "people_v2"]).await;
    assert_eq!(code, 0);
    assert_eq!(back["phase"], "cache_both");
    let (code, err) = shardctl(config(dbs), &["rollout", "advance", "nope"]).await;
    assert_eq!(code, 1);
    assert!(
        err["error"].as_str().unwrap().contains("people_v2"),
        "{err}"
    );
}

/// One bucket's rows on their shard against the other shard, which has
/// none of them: every row of the bucket is missing there.
async fn verify_shards_compares_one_bucket(dbs: &mut TestDbs) {
    let (code, _) = shardctl(config(dbs), &["migrate", "up"]).await;
    assert_eq!(code, 0);
    let cluster = Cluster::connect(config(dbs)).await.unwrap();
    cluster.setup::<contact::Entity>().await.unwrap();
    let target = cluster.route::<Customer>(&5).await.unwrap();
    let bucket = target.bucket.unwrap();
    let source = cluster.topology().shard(target.shard).name.clone();
    let other = cluster
        .topology()
        .shard_names()
        .find(|s| *s != source)
        .unwrap()
        .to_owned();
    let mut in_bucket = Vec::new();
    for id in 1..=20_i64 {
        let customer = id % 10;
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        tx.insert(contact::row(id, customer, &format!("v{id}@x"), "1"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        if cluster.route::<Customer>(&customer).await.unwrap().bucket == Some(bucket) {
            in_bucket.push(id.to_string());
        }
    }
    let bucket_text = bucket.to_string();
    let (code, report) = shardctl(
        config(dbs),
        &[
            "verify",
            "shards",
            "contacts",
            &source,
            &other,
            "--bucket",
            &bucket_text,
        ],
    )
    .await;
    assert_eq!(code, 1, "{report:#}");
    let mut missing: Vec<String> = report["missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["pk"].as_str().unwrap().to_owned())
        .collect();
    missing.sort();
    in_bucket.sort();
    assert_eq!(missing, in_bucket);
    let (code, report) = shardctl(
        config(dbs),
        &["verify", "shards", "contacts", &source, &source],
    )
    .await;
    assert_eq!(code, 0, "{report:#}");
    // A bucket the group does not have is a usage error naming the range,
    // not a clean report of no rows.
    let range = "invalid shardkit config at --bucket: bucket 99999999 is out of range: group \
                 Customer has buckets 0..=63 (64 buckets)";
    let args = [
        "verify", "shards", "contacts", &source, &other, "--bucket", "99999999",
    ];
    let (code, err) = shardctl(config(dbs), &args).await;
    assert_eq!(code, 2, "{err:#}");
    assert_eq!(err, serde_json::json!({ "error": range, "usage": true }));
    let (code, text) = shardctl_text(config(dbs), &args).await;
    assert_eq!((code, text), (2, format!("error: {range}\n")));
    let (code, _) = shardctl(
        config(dbs),
        &args.map(|a| if a == "99999999" { "64" } else { a }),
    )
    .await;
    assert_eq!(code, 2);
}

/// Shard keys an operator may paste: a newline, an escape byte, a quote, a
/// backslash, a bidirectional override.
const HOSTILE_KEYS: [&str; 6] = [
    "a\ns1: DELETE FROM notes",
    "\u{1b}[2J\u{1b}[31mred",
    "it's \"quoted\"",
    "back\\slash\\",
    "tab\there\r\n",
    "\u{202e}desrever",
];

/// A registry and config with a group keyed by text (notes, by tenant).
fn tenant_registry() -> Registry {
    registry().entity::<note::Entity>()
}

async fn shardctl_tenants(dbs: &TestDbs, json: bool, args: &[&str]) -> (u8, String) {
    let config = dbs.config(
        2,
        "[groups.Customer]\nbuckets = 64\n[groups.Tenant]\nbuckets = 64\n",
    );
    let mut out: Vec<u8> = Vec::new();
    let argv = ["shardctl"]
        .into_iter()
        .chain(json.then_some("--json"))
        .chain(args.iter().copied());
    let code = shardkit::cli::run_with(argv, config, tenant_registry(), &mut out).await;
    (code, String::from_utf8(out).unwrap())
}

/// `explain` of keys holding newlines, escape bytes, quotes and backslashes:
/// the text is one line per statement with no control character in it, and
/// `--json` is valid JSON whose statements hold each key's SQL as the
/// backend quotes it.
async fn explain_of_hostile_keys_is_escaped_text_and_valid_json(dbs: &mut TestDbs) {
    let cluster = Cluster::connect(dbs.config(
        2,
        "[groups.Customer]\nbuckets = 64\n[groups.Tenant]\nbuckets = 64\n",
    ))
    .await
    .unwrap();
    let no_control = |text: &str| {
        !text
            .chars()
            .any(|c| (c.is_control() && c != '\n') || ('\u{202a}'..='\u{202e}').contains(&c))
    };
    for key in HOSTILE_KEYS {
        let plan = cluster
            .find::<note::Entity>()
            .key(key.to_owned())
            .explain()
            .await
            .unwrap();
        assert_eq!(plan.statements.len(), 1);
        let shard = cluster.shard_of::<Tenant>(&key.to_owned()).await.unwrap();
        // The library's plan prints the same lines as the command.
        let lines: Vec<String> = plan.to_string().lines().map(str::to_owned).collect();
        assert_eq!(lines.len(), 2, "{key:?}: {lines:#?}");
        assert!(
            lines[0].starts_with("read notes (group Tenant) by key, bucket "),
            "{lines:?}"
        );
        assert!(
            lines[1].starts_with(&format!("  {shard}: SELECT ")),
            "{lines:?}"
        );
        assert!(no_control(&plan.to_string()), "{key:?}: {plan}");

        let (code, text) = shardctl_tenants(dbs, false, &["explain", "notes", "--key", key]).await;
        assert_eq!(code, 0, "{text}");
        assert_eq!(text, format!("{plan}\n"), "{key:?}");

        let (code, out) = shardctl_tenants(dbs, true, &["explain", "notes", "--key", key]).await;
        assert_eq!(code, 0, "{out}");
        let value: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{key:?}: not JSON ({e}): {out}"));
        // serde_json escapes every control character (the bidirectional
        // override is valid JSON as it is).
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "{key:?}: raw control characters in JSON: {out:?}"
        );
        assert_eq!(value["plan"], plan.to_string(), "{key:?}");
        assert_eq!(value["route"]["by"], "key");
        assert_eq!(
            value["statements"],
            serde_json::json!([{ "shard": shard, "sql": plan.statements[0].sql }]),
            "{key:?}"
        );
    }
    // Every key at once: one line per statement, then the merge.
    let mut args = vec!["explain", "notes"];
    for key in HOSTILE_KEYS {
        args.extend(["--key", key]);
    }
    let plan = cluster
        .find::<note::Entity>()
        .keys(HOSTILE_KEYS.map(str::to_owned))
        .explain()
        .await
        .unwrap();
    let (code, text) = shardctl_tenants(dbs, false, &args).await;
    assert_eq!(code, 0, "{text}");
    assert_eq!(text, format!("{plan}\n"));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + plan.statements.len() + 1, "{lines:#?}");
    for (line, statement) in lines[1..].iter().zip(&plan.statements) {
        assert!(
            line.starts_with(&format!("  {}: SELECT ", statement.shard)),
            "{line}"
        );
    }
    assert!(lines.last().unwrap().starts_with("  merge"), "{text}");
    assert!(no_control(&text), "{text:?}");
    let (code, out) = shardctl_tenants(dbs, true, &args).await;
    assert_eq!(code, 0, "{out}");
    let value: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        value["statements"].as_array().unwrap().len(),
        plan.statements.len()
    );
    // An error quoting a hostile key: one line of text, valid JSON.
    for key in HOSTILE_KEYS {
        let (code, text) = shardctl_tenants(dbs, false, &["route", "Customer", key]).await;
        assert_eq!(code, 1, "{text}");
        assert_eq!(text.lines().count(), 1, "{text:?}");
        assert!(text.starts_with("error: ") && no_control(&text), "{text:?}");
        let (code, out) = shardctl_tenants(dbs, true, &["route", "Customer", key]).await;
        assert_eq!(code, 1, "{out}");
        let value: Value = serde_json::from_str(&out).unwrap();
        assert!(value["error"].as_str().unwrap().contains(key), "{value:#}");
    }
}

/// With `--json` every output is one JSON object: a command line that does
/// not parse (exit code 2), `--help` and `--version` (exit code 0).
async fn json_output_is_json_for_usage_errors_and_help(dbs: &mut TestDbs) {
    for (args, code) in [
        (&["route"][..], 2),
        (&["explain", "contacts"][..], 2),
        (&["explain", "contacts", "--key", "1", "--scatter"][..], 2),
        (&["no-such-command"][..], 2),
        (
            &["verify", "shards", "contacts", "s0", "s1", "--bucket", "x"][..],
            2,
        ),
        (&["--help"][..], 0),
        (&["route", "--help"][..], 0),
        (&["--version"][..], 0),
    ] {
        let (got, value) = shardctl(config(dbs), args).await;
        assert_eq!(got, code, "{args:?}: {value:#}");
        let object = value.as_object().unwrap();
        if code == 2 {
            assert_eq!(object.len(), 2, "{value:#}");
            assert_eq!(value["usage"], true);
            let message = value["error"].as_str().unwrap();
            assert!(!message.starts_with("error:"), "{message}");
            assert!(!message.is_empty());
        } else {
            assert_eq!(object.len(), 1, "{value:#}");
            assert!(!value["help"].as_str().unwrap().is_empty(), "{value:#}");
        }
    }
    let (_, value) = shardctl(config(dbs), &["route"]).await;
    let message = value["error"].as_str().unwrap();
    assert!(
        message.starts_with("the following required arguments were not provided:")
            && message.contains("<GROUP>")
            && message.contains("\n\nUsage: shardctl route <GROUP> <KEY>\n"),
        "{message}"
    );
    // `--json` after the command's arguments counts too.
    let (code, value) = shardctl_text(config(dbs), &["route", "--json"]).await;
    assert_eq!(code, 2);
    let value: Value = serde_json::from_str(&value).unwrap();
    assert_eq!(value["usage"], true);
    // Without `--json`, clap's text.
    let (code, text) = shardctl_text(config(dbs), &["route"]).await;
    assert_eq!(code, 2);
    assert!(text.starts_with("error: "), "{text}");
}

/// `ids adopt-places` takes ticket servers that handed out tickets before
/// places were recorded; `ids clear-unconfirmed-places` undoes a set-up that
/// stopped after recording one server, so another list can set up.
async fn ids_commands_adopt_and_clear_ticket_places(dbs: &mut TestDbs) {
    let backend = format!("{:?}", dbs.backend).to_lowercase();
    let (a, b) = (format!("cli_a_{backend}"), format!("cli_b_{backend}"));
    let mut servers = Vec::new();
    let mut urls = Vec::new();
    for name in [&a, &b] {
        let url = dbs.extra(name).await;
        servers.push(format!("{{ name = \"{name}\", url = \"{url}\" }}"));
        urls.push(url);
    }
    let config = dbs.config(
        2,
        &format!(
            "[groups.Customer]\nbuckets = 64\n[ids]\nservers = [{}]\n[ids.sequences.cli]\nblock = 1\n",
            servers.join(", ")
        ),
    );
    let on_each = |sql: &'static str| {
        let urls = urls.clone();
        async move {
            for url in &urls {
                let db = sea_orm::Database::connect(url).await.unwrap();
                db.execute_unprepared(sql).await.unwrap();
                db.close().await.unwrap();
            }
        }
    };
    let cluster = Cluster::connect(config.clone()).await.unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    let mut ids = std::collections::HashSet::new();
    for _ in 0..4 {
        assert!(ids.insert(cluster.ids().next("cli").await.unwrap()));
    }
    drop(cluster);
    // As a release before recorded places leaves the servers.
    on_each("DELETE FROM shardkit_ticket_place").await;
    let (code, err) = shardctl(config.clone(), &["ids", "next", "cli"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("no confirmed place"),
        "{err}"
    );
    let (code, status) = shardctl(config.clone(), &["ids", "status"]).await;
    assert_eq!(code, 1, "{status:#}");
    assert_eq!(status["places"][0]["serves"], false, "{status:#}");
    assert_eq!(status["places"][1]["position"], Value::Null, "{status:#}");
    let (code, adopted) = shardctl(config.clone(), &["ids", "adopt-places"]).await;
    assert_eq!(code, 0, "{adopted}");
    assert_eq!(adopted["recorded"], serde_json::json!([a, b]));
    let (code, status) = shardctl(config.clone(), &["ids", "status"]).await;
    assert_eq!(code, 0, "{status:#}");
    for (i, name) in [&a, &b].into_iter().enumerate() {
        let place = &status["places"][i];
        assert_eq!(place["name"], name.as_str(), "{status:#}");
        assert_eq!(place["serves"], true, "{status:#}");
        assert_eq!(place["position"], i + 1, "{status:#}");
        assert_eq!(place["list"], serde_json::json!([a, b]), "{status:#}");
    }
    let (code, text) = shardctl_text(config.clone(), &["ids", "status"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(&format!("{b}: server 2 of 2")), "{text}");
    let (code, next) = shardctl(config.clone(), &["ids", "next", "cli"]).await;
    assert_eq!(code, 0, "{next}");
    assert!(ids.insert(next["id"].as_i64().unwrap()), "{next}");

    // A set-up of the reversed list that stopped after recording `b`.
    on_each("DELETE FROM shardkit_ticket_place").await;
    on_each("DELETE FROM tickets_cli").await;
    let mut reversed = config.clone();
    reversed.ids.servers.reverse();
    let stop = format!("shardkit::ids::place_recorded::{b}");
    fail::cfg(&stop, "return").unwrap();
    let stopped = Cluster::connect(reversed).await.unwrap();
    assert!(stopped.ids().record_places().await.is_err());
    fail::remove(&stop);
    let (code, err) = shardctl(config.clone(), &["ids", "adopt-places"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("clear_unconfirmed_places"),
        "{err}"
    );
    let (code, cleared) = shardctl(config.clone(), &["ids", "clear-unconfirmed-places"]).await;
    assert_eq!(code, 0, "{cleared}");
    assert_eq!(cleared["removed"], 1);
    let cluster = Cluster::connect(config).await.unwrap();
    cluster.ids().record_places().await.unwrap();
    assert!(cluster.ids().next("cli").await.unwrap() > 0);
}
