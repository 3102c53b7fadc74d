//! Growing from four shards to five while the application writes: the
//! quickstart's customers and orders on four SQLite shards, a fifth shard
//! added, and the fewest buckets that even the five out moved to it online,
//! with a writer task writing all along. It ends by checking every row the
//! writer was told it wrote: on its bucket's owner, once, as written.
//!
//! shardkit reports through the `metrics` facade; this program installs the
//! Prometheus exporter's recorder and serves its text on
//! `http://$SHARDKIT_METRICS_ADDR/metrics` (default: a free port on
//! 127.0.0.1, printed), and prints the move's metrics from there at the end.
//!
//! Run it with `cargo run -p shardkit-examples --bin rebalance`. Set
//! `SHARDKIT_DATA_DIR` to put the shard files somewhere other than
//! `data/rebalance`.

use indicatif::{ProgressBar, ProgressStyle};
use sea_orm::EntityTrait;
use shardkit::JobControl;
use shardkit::prelude::*;
use shardkit::rebalance::{MovePhase, MoveProgress};
use shardkit_examples::{Customer, Migrator, customer, order};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const CUSTOMERS: i64 = 2_000;

/// What the writer was told it wrote: each order (id → customer, total).
type Acked = Arc<Mutex<BTreeMap<i64, (i64, i64)>>>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Before the cluster connects: each shard's metrics register then.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let addr = std::env::var("SHARDKIT_METRICS_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let metrics_url = format!("http://{}/metrics", listener.local_addr()?);
    tokio::spawn(serve_metrics(listener, prometheus));
    println!("== metrics: {metrics_url}");

    // Five shard files; the group starts on the first four, and `s4` is in
    // no group's list: it gets buckets only by moves.
    let (dir, mut toml) = shardkit_examples::sqlite_shards("rebalance", 5)?;
    toml.push_str(
        "[groups.Customer]\nbuckets = 1024\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n\
         [rebalance]\nrefresh_ms = 200\ncleanup_grace_ms = 0\n",
    );
    println!(
        "== cluster: 4 SQLite shards and an empty fifth in {}",
        dir.display()
    );
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml)?).await?;
    cluster.migrate::<Migrator>().await?;
    cluster.refresh_bucket_maps().await?;

    println!("\n== {CUSTOMERS} customers with 3 orders each");
    let acked: Acked = Arc::default();
    for id in 1..=CUSTOMERS {
        let tx = cluster.begin::<Customer>(id).await?;
        tx.insert(customer::ActiveModel {
            id: Set(id),
            name: Set(format!("customer {id}")),
            email: Set(format!("c{id}@example.com")),
        })
        .await?;
        for n in 0..3 {
            let order = id * 10 + n;
            tx.insert(order::ActiveModel {
                id: Set(order),
                customer_id: Set(id),
                total_cents: Set(1_000 + n),
            })
            .await?;
            acked.lock().unwrap().insert(order, (id, 1_000 + n));
        }
        tx.commit().await?;
    }
    print_spread(&cluster).await?;

    // The application keeps writing: a new order for some customer, and
    // the customer's first order changed, in one transaction, in a loop;
    // every tenth transaction signs up a new customer with an order (the
    // order's foreign key needs its customer on the new shard first).
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (cluster, acked, stop) = (cluster.clone(), Arc::clone(&acked), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut writes = 0u64;
            let mut next = 100_000_000i64;
            while !stop.load(Ordering::SeqCst) {
                next += 1;
                let (new, total) = (next, next % 5_000);
                if next % 10 == 0 {
                    let id = CUSTOMERS + next;
                    cluster
                        .transaction::<Customer, _, _>(id, |tx| async move {
                            tx.insert(customer::ActiveModel {
                                id: Set(id),
                                name: Set(format!("customer {id}")),
                                email: Set(format!("c{id}@example.com")),
                            })
                            .await?;
                            tx.insert(order::ActiveModel {
                                id: Set(new),
                                customer_id: Set(id),
                                total_cents: Set(total),
                            })
                            .await
                        })
                        .await?;
                    acked.lock().unwrap().insert(new, (id, total));
                    writes += 1;
                    continue;
                }
                let id = (next * 7_919) % CUSTOMERS + 1;
                cluster
                    .transaction::<Customer, _, _>(id, |tx| async move {
                        tx.insert(order::ActiveModel {
                            id: Set(new),
                            customer_id: Set(id),
                            total_cents: Set(total),
                        })
                        .await?;
                        tx.update(order::ActiveModel {
                            id: sea_orm::ActiveValue::Unchanged(id * 10),
                            customer_id: sea_orm::ActiveValue::Unchanged(id),
                            total_cents: Set(total),
                        })
                        .await
                    })
                    .await?;
                let mut acked = acked.lock().unwrap();
                acked.insert(new, (id, total));
                acked.insert(id * 10, (id, total));
                writes += 1;
            }
            Ok::<u64, ShardError>(writes)
        })
    };

    println!("\n== moving buckets to s4 while the writer writes");
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template(
        "{spinner} {msg:<14} [{bar:30}] {pos}/{len} rows ({per_sec}, eta {eta})",
    )?);
    let shown = bar.clone();
    let moves = cluster
        .rebalance::<Customer>()?
        .entity::<customer::Entity>()
        .entity::<order::Entity>()
        .control(JobControl::new().on_progress(move |p: &MoveProgress| {
            shown.set_length(p.rows_estimated.max(p.rows_copied));
            shown.set_position(p.rows_copied);
            shown.set_message(format!("{} ({} behind)", p.phase, p.pending_changes));
        }));
    let plan = moves.plan_even_out("s4").await?;
    println!(
        "plan: {} of 1024 buckets to s4 ({} from each of s0..s3)",
        plan.buckets.len(),
        plan.buckets.len() / 4
    );
    let started = moves.start(&plan).await?;
    let done = moves.run(started.id).await?;
    bar.finish_with_message(done.phase.to_string());
    assert_eq!(done.phase, MovePhase::Done);
    println!(
        "move #{}: {} rows copied, {} logged keys replayed, bucket map epoch {}",
        done.id,
        done.rows_copied,
        done.changes_applied,
        cluster
            .topology()
            .live_owners("Customer")?
            .map_or(0, |o| o.epoch())
    );

    // A few more writes after the cut-over, then stop.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let writes = writer.await??;
    println!("the writer wrote {writes} transactions during the move, none refused");
    print_spread(&cluster).await?;

    println!("\n== verify: every order the writer was told about, on its owner, once");
    let acked = acked.lock().unwrap().clone();
    let differences = verify(&cluster, &acked).await?;
    println!("verify: {differences} differences");

    println!("\n== from {metrics_url}");
    for line in get(&metrics_url).await?.lines().filter(|l| {
        (l.starts_with("shardkit_move_") || l.starts_with("shardkit_bucket_"))
            && !l.starts_with('#')
    }) {
        println!("{line}");
    }
    if differences > 0 {
        return Err("the move lost or duplicated rows".into());
    }
    Ok(())
}

async fn print_spread(cluster: &Cluster) -> Result<(), Box<dyn std::error::Error>> {
    for name in cluster.topology().shard_names() {
        let db = cluster.connection(name).expect("configured shard");
        let orders = order::Entity::find().all(db).await?.len();
        println!("{name}: {orders:>5} orders");
    }
    Ok(())
}

/// An order as found: its shard, and (customer, total).
type Found = (String, (i64, i64));

/// Rows that are missing, misplaced, duplicated or different.
async fn verify(
    cluster: &Cluster,
    acked: &BTreeMap<i64, (i64, i64)>,
) -> Result<usize, Box<dyn std::error::Error>> {
    // Each order id: where it was found, with (customer, total).
    let mut found: BTreeMap<i64, Vec<Found>> = BTreeMap::new();
    for name in cluster.topology().shard_names() {
        let db = cluster.connection(name).expect("configured shard");
        for o in order::Entity::find().all(db).await? {
            found
                .entry(o.id)
                .or_default()
                .push((name.to_owned(), (o.customer_id, o.total_cents)));
        }
    }
    let mut differences = 0;
    for (id, row) in acked {
        let owner = cluster
            .shard_of_now::<Customer>(&row.0)?
            .unwrap_or_default();
        if found.remove(id) != Some(vec![(owner.to_owned(), *row)]) {
            differences += 1;
        }
    }
    Ok(differences + found.len())
}

/// Answers every connection with the Prometheus text of `handle`.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    handle: metrics_exporter_prometheus::PrometheusHandle,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    while let Ok((mut socket, _)) = listener.accept().await {
        let body = handle.render();
        tokio::spawn(async move {
            let mut request = [0u8; 1024];
            let _ = socket.read(&mut request).await;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
        });
    }
}

/// `GET url` (plain HTTP on loopback), the body.
async fn get(url: &str) -> Result<String, Box<dyn std::error::Error>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").ok_or("not an http URL")?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut socket = tokio::net::TcpStream::connect(host).await?;
    socket
        .write_all(format!("GET /{path} HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    socket.read_to_string(&mut response).await?;
    Ok(response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default())
}
