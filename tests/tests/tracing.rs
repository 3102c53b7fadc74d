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
