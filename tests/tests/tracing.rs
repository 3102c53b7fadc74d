//! Every routed statement runs inside a span naming its group, shard and
//! bucket; key values never appear at info level.

use sea_orm::Set;
use shardkit_tests::models::*;
use shardkit_tests::{Backend, TestDbs};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Debug)]
struct Captured {
    level: Level,
    name: String,
    fields: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<Vec<Captured>>>,
    by_id: Arc<Mutex<HashMap<u64, usize>>>,
    events: Arc<Mutex<Vec<Captured>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        spans.push(Captured {
            level: *attrs.metadata().level(),
            name: attrs.metadata().name().to_owned(),
            fields,
        });
        self.by_id
            .lock()
            .unwrap()
            .insert(id.into_u64(), spans.len() - 1);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(&index) = self.by_id.lock().unwrap().get(&id.into_u64()) {
            values.record(&mut Fields(&mut self.spans.lock().unwrap()[index].fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.events.lock().unwrap().push(Captured {
            level: *event.metadata().level(),
            name: event.metadata().name().to_owned(),
            fields,
        });
    }
}

#[tokio::test(flavor = "current_thread")]
async fn routed_statements_are_traced_without_keys() {
    let dbs = TestDbs::create(Backend::Sqlite, "tracing::routed_statements", 4).await;
    let cluster = dbs.cluster(4, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();

    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    const KEY: i64 = 987_654_321;
    let target = cluster.route::<Customer>(&KEY).await.unwrap();
    let shard = cluster.shard_of::<Customer>(&KEY).await.unwrap().to_owned();
    let tx = cluster.begin::<Customer>(KEY).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(KEY),
        total_cents: Set(5),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let rows = cluster
        .find::<order::Entity>()
        .key(KEY)
        .all()
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    drop(_guard);

    let spans = capture.spans.lock().unwrap().clone();
    let bucket = target.bucket.unwrap().to_string();
    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no `{name}` span in {spans:#?}"))
            .clone()
    };
    for name in ["shardkit.tx", "shardkit.read"] {
        let span = find(name);
        assert_eq!(span.level, Level::INFO, "{name}");
        assert_eq!(
            span.fields.get("group").map(String::as_str),
            Some("Customer"),
            "{name}: {span:?}"
        );
        assert_eq!(span.fields.get("shard"), Some(&shard), "{name}: {span:?}");
        assert_eq!(span.fields.get("bucket"), Some(&bucket), "{name}: {span:?}");
    }
    assert_eq!(
        find("shardkit.read")
            .fields
            .get("table")
            .map(String::as_str),
        Some("orders")
    );
    let write = find("shardkit.write");
    assert_eq!(write.fields.get("op").map(String::as_str), Some("insert"));

    // Keys may appear at debug level, never at info or above.
    let needle = KEY.to_string();
    let events = capture.events.lock().unwrap().clone();
    for item in spans.iter().chain(events.iter()) {
        if item.level <= Level::INFO {
            for (field, value) in &item.fields {
                assert!(
                    !value.contains(&needle),
                    "key value in info-level {} field {field}: {value}",
                    item.name
                );
            }
        }
    }
    assert!(
        events
            .iter()
            .any(|e| e.level == Level::DEBUG && e.fields.values().any(|v| v.contains(&needle))),
        "the key is available at debug level"
    );
    dbs.cleanup().await;
}

#[tokio::test(flavor = "current_thread")]
async fn scatter_concurrency_is_bounded_and_traced() {
    let dbs = TestDbs::create(Backend::Sqlite, "tracing::scatter_concurrency", 8).await;
    let cluster = dbs
        .cluster(8, "[groups.Customer]\n[read]\nmax_concurrency = 3\n")
        .await;
    cluster.migrate::<Migrator>().await.unwrap();

    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    // Cluster-wide bound from `[read] max_concurrency`, a per-query bound,
    // and one above the shard count.
    cluster
        .find::<order::Entity>()
        .scatter()
        .count()
        .await
        .unwrap();
    cluster
        .find::<order::Entity>()
        .scatter()
        .max_concurrency(1)
        .all()
        .await
        .unwrap();
    cluster
        .find::<order::Entity>()
        .scatter()
        .max_concurrency(64)
        .all()
        .await
        .unwrap();
    drop(_guard);

    let spans = capture.spans.lock().unwrap().clone();
    let scatters: Vec<&Captured> = spans
        .iter()
        .filter(|s| s.name == "shardkit.scatter")
        .collect();
    assert_eq!(scatters.len(), 3);
    let peaks: Vec<&str> = scatters
        .iter()
        .map(|s| {
            s.fields
                .get("peak_in_flight")
                .map(String::as_str)
                .unwrap_or("?")
        })
        .collect();
    assert_eq!(peaks, vec!["3", "1", "8"], "statements in flight at once");
    let scatter = scatters[0];
    assert_eq!(
        scatter.fields.get("group").map(String::as_str),
        Some("Customer")
    );
    assert_eq!(
        scatter.fields.get("shards_asked").map(String::as_str),
        Some("8")
    );
    assert_eq!(
        scatter.fields.get("shards_failed").map(String::as_str),
        Some("0")
    );
    assert_eq!(
        scatter.fields.get("rows").map(String::as_str),
        Some("0"),
        "count of an empty table"
    );
    assert_eq!(
        spans.iter().filter(|s| s.name == "shardkit.read").count(),
        24
    );
    drop(cluster);
    dbs.cleanup().await;
}

/// Every form a password can take in a URL, as one of them would be written
/// in a config and as a driver would decode it. All contain `Qz7`, which
/// nothing else prints.
const SECRET_MARK: &str = "Qz7";

/// Connecting, reading, writing and failing at TRACE level, with passwords
/// in the userinfo (percent-encoded), in a `password=` parameter and in a
/// percent-encoded `pass%77ord=` parameter: no span or event of shardkit or
/// of its dependencies (SeaORM, sqlx) records any of them, and neither do
/// the errors or the `Debug` of the config, the topology and the cluster.
async fn passwords_never_reach_trace_output(backend: Backend) {
    use sea_orm::{ConnectionTrait, Database};
    use shardkit::{Cluster, ClusterConfig};

    let test = format!("tracing::passwords_{backend:?}");
    let mut dbs = TestDbs::create(backend, &test, 2).await;
    let server = backend.server_url().unwrap();
    let host = server.rsplit('@').next().unwrap().to_owned();
    let tickets = dbs.extra("tickets").await;
    let ticket_db = tickets.rsplit('/').next().unwrap().to_owned();
    // Decoded `Qz7/u@ser`; PostgreSQL (trust) accepts any password, MariaDB
    // gets a user that has this one.
    let userinfo = "Qz7%2Fu%40ser";
    let (user, shard1, ticket_url) = match backend {
        Backend::MySql => {
            let admin = Database::connect(server.as_str()).await.unwrap();
            for from in ["%", "localhost", "127.0.0.1"] {
                let who = format!("'sk_trace'@'{from}'");
                admin
                    .execute_unprepared(&format!("DROP USER IF EXISTS {who}"))
                    .await
                    .unwrap();
                admin
                    .execute_unprepared(&format!("CREATE USER {who} IDENTIFIED BY 'Qz7/u@ser'"))
                    .await
                    .unwrap();
                for db in &dbs.names {
                    admin
                        .execute_unprepared(&format!("GRANT ALL ON `{db}`.* TO {who}"))
                        .await
                        .unwrap();
                }
            }
            // sqlx's MySQL driver reads no `password` parameter: every shard
            // gives it in the userinfo.
            (
                "sk_trace",
                format!("mysql://sk_trace:{userinfo}@{host}/{}", dbs.names[1]),
                format!("mysql://sk_trace:{userinfo}@{host}/{ticket_db}"),
            )
        }
        _ => (
            "postgres",
            format!(
                "postgres://postgres@{host}/{}?password=Qz7query",
                dbs.names[1]
            ),
            format!("postgres://postgres@{host}/{ticket_db}?sslmode=prefer&pass%77ord=Qz7key"),
        ),
    };
    let scheme = if backend == Backend::MySql {
        "mysql"
    } else {
        "postgres"
    };
    let toml = format!(
        r#"
[pool]
max_connections = 2
[[hosts]]
name = "server"
url = "{scheme}://{user}:{userinfo}@{host}"
[[shards]]
name = "s0"
host = "server"
database = "{db0}"
[[shards]]
name = "s1"
url = "{shard1}"
[groups.Customer]
[ids]
servers = [{{ name = "t", url = "{ticket_url}" }}]
[ids.sequences.invoices]
block = 1
"#,
        db0 = dbs.names[0],
    );

    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let guard = tracing::subscriber::set_default(subscriber);
    let mut printed = Vec::new();

    let config = ClusterConfig::from_toml(&toml).unwrap();
    printed.push(format!("{config:?}"));
    let cluster = Cluster::connect(config.clone()).await.unwrap();
    printed.push(format!("{:?}", cluster.topology()));
    printed.push(format!("{cluster:?}"));
    printed.push(format!(
        "{:?} {:?}",
        cluster.connection("s1"),
        cluster.ids()
    ));
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.ids().create_sequence("invoices").await.unwrap();
    for key in [1_i64, 2, 3, 4] {
        let tx = cluster.begin::<Customer>(key).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(key),
            customer_id: Set(key),
            total_cents: Set(5),
        })
        .await
        .unwrap();
        tx.insert(invoice::ActiveModel {
            id: sea_orm::ActiveValue::NotSet,
            customer_id: Set(key),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let rows = cluster
            .find::<order::Entity>()
            .key(key)
            .all()
            .await
            .unwrap();
        assert_eq!(rows.len(), 1);
    }
    // Failing: a statement the database refuses, a shard that refuses
    // connections, a password in a parameter the MySQL driver ignores
    // (access denied), a config value of the wrong type.
    let err = cluster
        .find::<ghost::Entity>()
        .key(1)
        .all()
        .await
        .unwrap_err();
    printed.push(format!("{err} {err:?}"));
    let mut failing = vec![format!(
        "{scheme}://{user}:Qz7closed@127.0.0.1:9/x?password=Qz7closedq"
    )];
    if backend == Backend::MySql {
        failing.push(format!(
            "mysql://sk_trace@{host}/{}?password=Qz7ignored",
            dbs.names[0]
        ));
    }
    for url in failing {
        let toml = format!(
            "[[shards]]\nname = \"down\"\nurl = \"{url}\"\n[pool]\nconnect_timeout_secs = 5\n"
        );
        let err = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
            .await
            .unwrap_err();
        assert!(
            matches!(err, shardkit::ShardError::Connect { .. }),
            "{err:?}"
        );
        printed.push(format!("{err} {err:?}"));
    }
    let err = ClusterConfig::from_toml(&format!(
        "[[shards]]\nname = \"s0\"\nurl = \"sqlite://x.db\"\n[pool]\nmax_connections = \"{scheme}://u:Qz7PwK/0o1@h/db?password=Qz7wrongtype\"\n"
    ))
    .unwrap_err();
    printed.push(format!("{err} {err:?}"));
    drop(cluster);
    drop(guard);

    let spans = capture.spans.lock().unwrap().clone();
    let events = capture.events.lock().unwrap().clone();
    // The capture sees the dependencies' TRACE spans: SeaORM's connect span
    // records its options, URL included.
    assert!(
        spans
            .iter()
            .any(|s| s.name == "connect"
                && s.fields.get("options").is_some_and(|o| o.contains(&host))),
        "SeaORM's connect span was not captured: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    assert!(spans.iter().any(|s| s.level == Level::TRACE));
    for item in spans.iter().chain(events.iter()) {
        for (field, value) in &item.fields {
            assert!(
                !value.contains(SECRET_MARK),
                "a password in {:?} {} field {field}: {value}",
                item.level,
                item.name
            );
        }
    }
    for text in &printed {
        assert!(!text.contains(SECRET_MARK), "a password printed: {text}");
    }
    dbs.cleanup().await;
}

#[tokio::test(flavor = "current_thread")]
async fn passwords_never_reach_trace_output_postgres() {
    passwords_never_reach_trace_output(Backend::Postgres).await;
}

#[tokio::test(flavor = "current_thread")]
async fn passwords_never_reach_trace_output_mysql() {
    passwords_never_reach_trace_output(Backend::MySql).await;
}
