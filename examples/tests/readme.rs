//! The documentation's code, compiled and run: README.md and the guide's
//! chapters, `shardkit/docs/*.md`.
//!
//! Every `rust` block of those files appears in this file verbatim, inside
//! code that compiles: the entities and the migrator it assumes, and async
//! functions around its statements that the tests below run on SQLite shards
//! in a scratch directory, checking what a reader of the documentation relies
//! on. `doc_rust_snippets_are_compiled_here` reads the files and fails,
//! naming the file and line, when a snippet's lines do not occur here in
//! order (leading indentation aside; a blank line in a snippet may stand for
//! any code here, which is how one snippet spans module items and a function
//! body). So a documentation edit means editing its copy here, where the
//! compiler checks it; the snippet code is `#[rustfmt::skip]` so it stays as
//! the documentation shows it. `toml` blocks are parsed with
//! `ClusterConfig::from_toml`.

use shardkit::clock::{Clock, ManualClock};
use shardkit::gsi::{BackfillProgress, IndexState, ReconcileReport};
use shardkit::rebalance::{MovePhase, MoveStatus};
use shardkit::{
    CancellationToken, JobControl, Partial, Rollout, RolloutHandle, VerifyOptions, VerifyReport,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

// README.md, "What it looks like": the declarations.

use shardkit::prelude::*;

#[rustfmt::skip]
#[derive(EntityGroup)]
#[shardkit(key = i64)]                 // the shard key type of every member
pub struct Customer;

#[rustfmt::skip]
pub mod order {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "orders")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub total_cents: i64,
        #[sea_orm(has_many)]
        pub lines: HasMany<super::line::Entity>,   // SeaORM 2.0 relations, on the model
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// What the statements of "What it looks like" read, and the cluster they
/// wrote through, for the test to check.
struct Looks {
    cluster: Cluster,
    mine: Vec<order::Model>,
    totals: Vec<(i64, i64)>,
    some: Vec<order::Model>,
    top: Vec<order::Model>,
    part: Partial<Vec<order::Model>>,
    /// What the transaction closure returned.
    id: i64,
}

/// README.md, "What it looks like": the statements, on the cluster `TOML`
/// describes.
#[rustfmt::skip]
#[allow(non_snake_case)] // the README names the config the way a program's `const TOML` would be
async fn what_it_looks_like(TOML: &str) -> shardkit::Result<Looks> {
    let cluster = Cluster::connect(ClusterConfig::from_toml(TOML)?).await?;
    cluster.migrate::<migration::Migrator>().await?;           // every shard, per-shard report

    // Reads: a key is required before anything runs.
    let mine = cluster.find::<order::Entity>().key(42)
        .filter(order::Column::TotalCents.gt(1_000))
        .all().await?;
    let totals: Vec<(i64, i64)> = cluster.find::<order::Entity>().key(42)   // SeaORM projections
        .select_only().column(order::Column::Id).column(order::Column::TotalCents)
        .into_tuple().all().await?;
    let some = cluster.find::<order::Entity>().keys([1, 2, 3]).all().await?;   // one IN list per shard
    let top = cluster.find::<order::Entity>().scatter()                        // every shard, on purpose
        .order_by_desc(order::Column::TotalCents).limit(10).all().await?;      // merged like one database
    let part = cluster.find::<order::Entity>().scatter().partial().all().await?; // rows + failed shards

    // Writes: one group, one key, one shard.
    let tx = cluster.begin::<Customer>(42).await?;
    tx.insert(order::ActiveModel { id: Set(1), customer_id: Set(42), total_cents: Set(1_999) }).await?;
    tx.commit().await?;

    // Or as a closure: commits on Ok, rolls back on Err, reruns a transaction the database
    // aborted (deadlock, serialization failure) up to 3 times.
    let id = cluster.transaction::<Customer, _, _>(42, |tx| async move {
        let row = tx.insert(order::ActiveModel { id: Set(2), customer_id: Set(42), total_cents: Set(500) }).await?;
        Ok(row.id)
    }).await?;

    Ok(Looks { cluster, mine, totals, some, top, part, id })
}

// shardkit/docs/seaorm.md ("SeaORM inside a key").

#[rustfmt::skip]
pub mod line {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "order_lines")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,                   // lines live with their order
        pub order_id: i64,
        pub sku: String,
        #[sea_orm(belongs_to, from = "order_id", to = "id")]
        pub order: BelongsTo<super::order::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// What the statements of shardkit/docs/seaorm.md returned.
struct Inside {
    saved: order::ActiveModel,
    orders: Vec<(order::Model, Vec<line::Model>)>,
    lines: Vec<line::Model>,
    streamed: usize,
    ids: Vec<i64>,
}

/// shardkit/docs/seaorm.md ("SeaORM inside a key"): the statements.
#[rustfmt::skip]
async fn inside_a_key(cluster: &Cluster) -> shardkit::Result<Inside> {
    use futures::TryStreamExt;                      // for streams

    let tx = cluster.begin::<Customer>(42).await?;
    tx.insert_many((1..=3).map(|id| line::ActiveModel {                     // every row's key checked first
        id: Set(id), customer_id: Set(42), order_id: Set(1), sku: Set(format!("sku-{id}")),
    })).await?;
    tx.update_many::<order::Entity>()                                        // `customer_id = 42` always added
        .set(order::ActiveModel { total_cents: Set(0), ..Default::default() })
        .filter(order::Column::TotalCents.lt(100))
        .exec().await?;
    tx.delete_many::<line::Entity>().filter(line::Column::Sku.eq("sku-3")).exec().await?;
    let saved = tx.save(order::ActiveModel { id: Set(1), customer_id: Set(42), total_cents: Set(2_500) }).await?;
    tx.commit().await?;

    let orders = cluster.find::<order::Entity>().key(42)                     // each order with its lines,
        .find_with_related(line::Entity).await?;                             // both sides within key 42
    let lines = cluster.find_related(&orders[0].0, line::Entity).all().await?;  // a keyed read of `line`
    let mut rows = cluster.find::<order::Entity>().key(42).stream().await?;  // decoded as they arrive
    let mut streamed = 0;
    while let Some(order) = rows.try_next().await? { assert_eq!(order.customer_id, 42); streamed += 1; }
    let ids: Vec<i64> = cluster.find::<order::Entity>().scatter()            // unordered projections of
        .select_only().column(order::Column::Id).into_tuple().all().await?;  // several shards merge
    Ok(Inside { saved, orders, lines, streamed, ids })
}

/// Contacts, with the two indexed fields of shardkit/docs/gsi.md ("Global
/// secondary indexes").
#[rustfmt::skip]
pub mod contact {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "contacts")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        #[shardkit(global_index(unique))]      // on a field of a #[derive(Sharded)] model
        pub email: String,
        #[shardkit(global_index)]              // non-unique: a family's shared phone number
        pub phone: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// shardkit/docs/gsi.md ("Global secondary indexes"): the statements.
#[rustfmt::skip]
async fn global_secondary_indexes(
    cluster: &Cluster,
) -> shardkit::Result<(Vec<contact::Model>, ReconcileReport)> {
    cluster.gsi().create::<contact::Entity>().await?;                        // tables + catalog (write_only)
    cluster.gsi().backfill::<contact::Entity>(contact::Column::Email).await?; // fill, then active
    let rows = cluster.find::<contact::Entity>().by_index(contact::Column::Email, "a@x").all().await?;
    let report = cluster.gsi().reconcile::<contact::Entity>().await?;        // scanned / removed / added
    Ok((rows, report))
}

/// shardkit/docs/gsi.md ("Progress and stopping long jobs"): a backfill
/// under a `JobControl`; `cancelled` cancels its token before it runs, as a
/// Ctrl-C handler would.
#[rustfmt::skip]
async fn progress_and_stopping(cluster: &Cluster, cancelled: bool) -> shardkit::Result<BackfillProgress> {
    let stop = CancellationToken::new();    // cancel it on Ctrl-C, at shutdown, from another task
    if cancelled {
        stop.cancel();
    }
    let control = JobControl::new()
        .on_progress(|p: &BackfillProgress| eprintln!("{} rows, {}/{} shards", p.rows, p.shards_done, p.shards))
        .cancel_on(stop.clone());
    let done = cluster.gsi().backfill_with::<contact::Entity>(contact::Column::Phone, 500, control).await?;
    // done.finished is false when `stop` was cancelled: run it again to resume
    Ok(done)
}

/// The old model of shardkit/docs/rollouts.md ("Denormalisation rollouts"):
/// a person's name in two columns.
pub mod person_v1 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "people")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub first_name: String,
        pub last_name: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The new model: the display name stored with the parts.
pub mod person_v2 {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "people_v2")]
    #[shardkit(group = crate::Customer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        #[shardkit(shard_key)]
        pub customer_id: i64,
        pub first_name: String,
        pub last_name: String,
        pub display_name: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

fn to_v2(old: &person_v1::Model) -> person_v2::Model {
    person_v2::Model {
        id: old.id,
        customer_id: old.customer_id,
        first_name: old.first_name.clone(),
        last_name: old.last_name.clone(),
        display_name: format!("{} {}", old.first_name, old.last_name),
    }
}

fn to_v1(new: &person_v2::Model) -> person_v1::Model {
    person_v1::Model {
        id: new.id,
        customer_id: new.customer_id,
        first_name: new.first_name.clone(),
        last_name: new.last_name.clone(),
    }
}

type People = RolloutHandle<person_v1::Entity, person_v2::Entity>;

/// shardkit/docs/rollouts.md ("Denormalisation rollouts"): the statements,
/// reading back person `id` of customer `customer_id`.
#[rustfmt::skip]
async fn rollouts(
    cluster: &Cluster,
    customer_id: i64,
    id: i64,
) -> shardkit::Result<(People, Option<person_v2::Model>, VerifyReport)> {
    let people = cluster
        .register_rollout(
            Rollout::<person_v1::Entity, person_v2::Entity>::new("people_v2", to_v2)
                .to_old(to_v1)                        // needed from read_new on
                .cache_ttl(Duration::from_secs(60))
                .refresh_interval(Duration::from_secs(5)),
        )
        .await?;
    people.backfill().await?;                          // in dual_write, a gap after it: copy old rows
    people.advance().await?;                           // off → cache_both → dual_write → read_new → ...
    let new = people.get_new(customer_id, id).await?;  // cached, phase-aware reads of either model
    let report = people.verify(VerifyOptions::default().repair()).await?;
    Ok((people, new, report))
}

/// What the statements of shardkit/docs/ids.md ("Ids") returned.
struct Issued {
    id: i64,
    seq: Arc<shardkit::Sequence>,
    sf: i64,
    u: shardkit::sea_orm::prelude::Uuid,
    enc: i64,
    target: shardkit::Target,
}

/// shardkit/docs/ids.md ("Ids"): the statements.
#[rustfmt::skip]
async fn ids(cluster: &Cluster) -> shardkit::Result<Issued> {
    let id = cluster.ids().next("orders").await?;                  // ticket sequence (blocks of B)
    let seq = cluster.ids().sequence("orders")?;                   // keep the handle on hot paths
    let sf = cluster.ids().snowflake()?;                           // 41/10/12 bits, epoch 2026-01-01 UTC
    let u = shardkit::uuid_v7();                                   // time-ordered, monotonic in-process
    let enc = cluster.next_encoded_id::<Customer>("orders", &42).await?;  // bucket in the low 13 bits
    let target = cluster.route_id::<Customer>(enc)?;               // the shard, from the id alone
    Ok(Issued { id, seq, sf, u, enc, target })
}

/// shardkit/docs/rebalance.md ("Moving buckets").
#[rustfmt::skip]
async fn grow(cluster: &Cluster) -> shardkit::Result<MoveStatus> {
    let moves = cluster.rebalance::<Customer>()?.entity::<order::Entity>();  // every entity of the group
    let plan = moves.plan_even_out("s4").await?;           // the fewest buckets that even the shards out
    let started = moves.start(&plan).await?;               // refused if another move holds a bucket
    moves.run(started.id).await                            // copy, catch up, verify, cut over, clean
}

/// shardkit/docs/rebalance.md ("Moving buckets"): adding a shard.
#[rustfmt::skip]
async fn add_shard(config: ClusterConfig) -> shardkit::Result<MoveStatus> {
    let cluster = Cluster::connect(config).await?;         // s4 listed, its database empty
    cluster.migrate::<migration::Migrator>().await?;       // s4's tables and bucket states
    grow(&cluster).await                                   // then moves hand it buckets
}

/// The application's migrations the documentation's `migration::Migrator`
/// stands for: shardkit's tables, then one table per entity above.
mod migration {
    use sea_orm_migration::prelude::*;

    /// Creates one entity's table.
    struct CreateTable<E>(&'static str, E);

    impl<E: sea_orm::EntityTrait> MigrationName for CreateTable<E> {
        fn name(&self) -> &str {
            self.0
        }
    }

    #[async_trait::async_trait]
    impl<E: sea_orm::EntityTrait + Sync> MigrationTrait for CreateTable<E> {
        async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
            let schema = sea_orm::Schema::new(manager.get_database_backend());
            manager
                .create_table(
                    schema
                        .create_table_from_entity(self.1)
                        .if_not_exists()
                        .to_owned(),
                )
                .await
        }

        async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
            manager
                .drop_table(Table::drop().table(self.1).to_owned())
                .await
        }
    }

    pub struct Migrator;

    #[async_trait::async_trait]
    impl MigratorTrait for Migrator {
        fn migrations() -> Vec<Box<dyn MigrationTrait>> {
            let mut all = shardkit_migration::migrations();
            all.extend::<[Box<dyn MigrationTrait>; 5]>([
                Box::new(CreateTable("m20261201_000001_orders", super::order::Entity)),
                Box::new(CreateTable(
                    "m20261201_000005_order_lines",
                    super::line::Entity,
                )),
                Box::new(CreateTable(
                    "m20261201_000002_contacts",
                    super::contact::Entity,
                )),
                Box::new(CreateTable(
                    "m20261201_000003_people",
                    super::person_v1::Entity,
                )),
                Box::new(CreateTable(
                    "m20261201_000004_people_v2",
                    super::person_v2::Entity,
                )),
            ]);
            all
        }
    }
}

// ---------------------------------------------------------------------------
// Running the snippets.

/// A directory of SQLite shard files, unique to this process and test,
/// removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("shardkit-readme-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }

    fn url(&self, db: &str) -> String {
        format!(
            "sqlite://{}?mode=rwc",
            self.0.join(format!("{db}.db")).display()
        )
    }

    /// `n` shards and the `Customer` group hashed over them.
    fn cluster_toml(&self, n: usize) -> String {
        let mut toml = String::new();
        for i in 0..n {
            toml.push_str(&format!(
                "[[shards]]\nname = \"s{i}\"\nurl = \"{}\"\n\n",
                self.url(&format!("s{i}"))
            ));
        }
        toml.push_str("[groups.Customer]\nplacement = \"hash\"\nbuckets = 1024\n");
        toml
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A migrated cluster on `toml` (another instance than the snippet's).
async fn migrated(toml: &str) -> Cluster {
    let cluster = Cluster::connect(ClusterConfig::from_toml(toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<migration::Migrator>().await.unwrap();
    cluster
}

/// The orders seeded before the README's reads: three per customer 1..=40
/// and 42, with totals spread over 0..5000 cents.
fn seeded_orders() -> Vec<order::Model> {
    (1..=40)
        .chain([42])
        .flat_map(|customer: i64| {
            (1..=3).map(move |n| order::Model {
                id: customer * 10 + n,
                customer_id: customer,
                total_cents: (customer * 397 + n * 1_201) % 5_000,
            })
        })
        .collect()
}

fn sorted(mut rows: Vec<order::Model>) -> Vec<order::Model> {
    rows.sort_by_key(|o| o.id);
    rows
}

#[tokio::test]
async fn what_it_looks_like_reads_and_writes_as_described() {
    let scratch = Scratch::new("looks");
    let toml = scratch.cluster_toml(4);
    let seeded = seeded_orders();
    {
        let cluster = migrated(&toml).await;
        for customer in (1..=40).chain([42]) {
            let tx = cluster.begin::<Customer>(customer).await.unwrap();
            for o in seeded.iter().filter(|o| o.customer_id == customer) {
                tx.insert(order::ActiveModel {
                    id: Set(o.id),
                    customer_id: Set(o.customer_id),
                    total_cents: Set(o.total_cents),
                })
                .await
                .unwrap();
            }
            tx.commit().await.unwrap();
        }
    }

    let looks = what_it_looks_like(&toml).await.unwrap();

    let of = |customers: &[i64]| -> Vec<order::Model> {
        seeded
            .iter()
            .filter(|o| customers.contains(&o.customer_id))
            .cloned()
            .collect()
    };
    let mine: Vec<_> = of(&[42])
        .into_iter()
        .filter(|o| o.total_cents > 1_000)
        .collect();
    assert!(
        !mine.is_empty(),
        "the seed gives customer 42 an order over 1000"
    );
    assert_eq!(sorted(looks.mine), mine);
    let mut totals = looks.totals;
    totals.sort();
    assert_eq!(
        totals,
        of(&[42])
            .iter()
            .map(|o| (o.id, o.total_cents))
            .collect::<Vec<_>>()
    );
    assert_eq!(sorted(looks.some), of(&[1, 2, 3]));
    let mut by_total: Vec<i64> = seeded.iter().map(|o| o.total_cents).collect();
    by_total.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(
        looks.top.iter().map(|o| o.total_cents).collect::<Vec<_>>(),
        by_total[..10],
        "scatter + order_by_desc + limit(10) is the top 10 of all shards"
    );
    assert!(looks.top.iter().all(|o| seeded.contains(o)));
    assert!(looks.part.is_complete(), "{:?}", looks.part.failed_shards());
    assert_eq!(sorted(looks.part.rows), sorted(seeded.clone()));

    // The committed orders are on customer 42's shard and on no other.
    assert_eq!(looks.id, 2, "the closure's value");
    let cluster = &looks.cluster;
    let home = cluster.shard_of::<Customer>(&42).await.unwrap().to_owned();
    for (id, total_cents) in [(1, 1_999), (2, 500)] {
        for name in cluster.topology().shard_names() {
            let db = cluster.connection(name).unwrap();
            let found = order::Entity::find_by_id(id).one(db).await.unwrap();
            let expected = (name == home).then_some(order::Model {
                id,
                customer_id: 42,
                total_cents,
            });
            assert_eq!(found, expected, "order {id} on shard {name} (home {home})");
        }
    }
}

#[tokio::test]
async fn inside_a_key_reads_and_writes_as_described() {
    let scratch = Scratch::new("inside");
    let toml = scratch.cluster_toml(4);
    let cluster = migrated(&toml).await;
    // Orders 1 (1999 cents) and 2 (50 cents) of customer 42, order 3 of customer 7.
    for (id, customer, total) in [(1, 42, 1_999), (2, 42, 50), (3, 7, 10)] {
        let tx = cluster.begin::<Customer>(customer).await.unwrap();
        tx.insert(order::ActiveModel {
            id: Set(id),
            customer_id: Set(customer),
            total_cents: Set(total),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }

    let inside = inside_a_key(&cluster).await.unwrap();

    assert_eq!(inside.saved.total_cents.clone().unwrap(), 2_500);
    let got: Vec<(i64, i64, Vec<&str>)> = inside
        .orders
        .iter()
        .map(|(o, lines)| {
            (
                o.id,
                o.total_cents,
                lines.iter().map(|l| l.sku.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![(1, 2_500, vec!["sku-1", "sku-2"]), (2, 0, vec![])],
        "update_many zeroed order 2 only, delete_many removed sku-3, save updated order 1"
    );
    assert_eq!(inside.lines.len(), 2);
    assert_eq!(inside.streamed, 2);
    let mut ids = inside.ids;
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2, 3]);
    let other = cluster
        .find::<order::Entity>()
        .key(7)
        .one()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        other.total_cents, 10,
        "another key's order under 100 cents is untouched"
    );
}

#[tokio::test]
async fn global_secondary_indexes_find_rows_by_email() {
    let scratch = Scratch::new("gsi");
    let toml = scratch.cluster_toml(4);
    let cluster = migrated(&toml).await;
    // Rows written before the index exists, straight to their shards.
    let contacts: Vec<contact::Model> = (1..=20_i64)
        .map(|id| contact::Model {
            id,
            customer_id: id * 7,
            email: if id == 13 {
                "a@x".to_owned()
            } else {
                format!("c{id}@example.com")
            },
            phone: format!("555-010{}", id % 3),
        })
        .collect();
    for c in &contacts {
        let shard = cluster.shard_of::<Customer>(&c.customer_id).await.unwrap();
        let db = cluster.connection(shard).unwrap();
        contact::Entity::insert(contact::ActiveModel::from(c.clone()))
            .exec(db)
            .await
            .unwrap();
    }

    let (rows, report) = global_secondary_indexes(&cluster).await.unwrap();

    assert_eq!(rows, vec![contacts[12].clone()]);
    assert_eq!(
        cluster
            .gsi()
            .state::<contact::Entity>(contact::Column::Email)
            .await
            .unwrap(),
        IndexState::Active
    );
    assert_eq!(report.removed, 0, "nothing dangles: {report:?}");
}

#[tokio::test]
async fn a_cancelled_backfill_stops_and_the_next_call_resumes() {
    let scratch = Scratch::new("gsi_progress");
    let toml = scratch.cluster_toml(4);
    let cluster = migrated(&toml).await;
    // Rows written before the index exists, straight to their shards.
    for id in 1..=12_i64 {
        let shard = cluster.shard_of::<Customer>(&id).await.unwrap();
        let row = contact::ActiveModel {
            id: Set(id),
            customer_id: Set(id),
            email: Set(format!("c{id}@example.com")),
            phone: Set(format!("555-010{}", id % 3)),
        };
        contact::Entity::insert(row)
            .exec(cluster.connection(shard).unwrap())
            .await
            .unwrap();
    }
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    let gsi = cluster.gsi();
    let state = || gsi.state::<contact::Entity>(contact::Column::Phone);

    let stopped = progress_and_stopping(&cluster, true).await.unwrap();
    assert!(!stopped.finished && stopped.rows == 0, "{stopped:?}");
    assert_eq!(state().await.unwrap(), IndexState::WriteOnly);
    let done = progress_and_stopping(&cluster, false).await.unwrap();
    assert!(done.finished && done.shards_done == 4, "{done:?}");
    assert_eq!(state().await.unwrap(), IndexState::Active);
}

#[tokio::test]
async fn rollouts_advance_backfill_and_verify() {
    let scratch = Scratch::new("rollouts");
    let toml = scratch.cluster_toml(4);
    let people: Vec<person_v1::Model> = (1..=30_i64)
        .map(|id| person_v1::Model {
            id,
            customer_id: id % 9 + 1,
            first_name: format!("first{id}"),
            last_name: format!("last{id}"),
        })
        .collect();
    // Both instances read one clock, so the test can let the phase gaps pass.
    let clock = Arc::new(ManualClock::starting_now());
    let on_clock = || {
        Cluster::builder(ClusterConfig::from_toml(&toml).unwrap())
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .connect()
    };
    let hour = Duration::from_secs(3_600);
    {
        // Another instance wrote the people, registered the rollout and moved
        // it to cache_both, then to dual_write, an hour apart.
        let cluster = on_clock().await.unwrap();
        cluster.migrate::<migration::Migrator>().await.unwrap();
        for p in &people {
            let tx = cluster.begin::<Customer>(p.customer_id).await.unwrap();
            tx.insert(person_v1::ActiveModel::from(p.clone()))
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        let other: People = cluster
            .register_rollout(Rollout::new("people_v2", to_v2).to_old(to_v1))
            .await
            .unwrap();
        for phase in [shardkit::Phase::CacheBoth, shardkit::Phase::DualWrite] {
            assert_eq!(other.advance().await.unwrap(), phase);
            clock.advance(hour);
        }
    }

    // An hour later the gap (the snippet's TTL + refresh, 65 s) is over.
    let p = &people[16];
    let cluster = on_clock().await.unwrap();
    let (handle, new, report) = rollouts(&cluster, p.customer_id, p.id).await.unwrap();

    assert_eq!(handle.phase(), shardkit::Phase::ReadNew);
    assert_eq!(new, Some(to_v2(p)));
    assert!(report.finished, "{report:?}");
    assert_eq!(report.rows, people.len() as u64, "{report:?}");
    assert!(
        report.is_consistent(),
        "the backfill copied every person: {report:?}"
    );
}

#[tokio::test]
async fn a_shard_added_to_a_running_cluster_is_migrated_and_takes_buckets() {
    let scratch = Scratch::new("add");
    let shards = scratch
        .cluster_toml(4)
        .split("[groups.Customer]")
        .next()
        .unwrap()
        .to_owned();
    let group = "[groups.Customer]\nbuckets = 64\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n[rebalance]\ncleanup_grace_ms = 0\n";
    {
        let running = migrated(&format!("{shards}{group}")).await;
        running.refresh_bucket_maps().await.unwrap();
        for order in seeded_orders() {
            let tx = running.begin::<Customer>(order.customer_id).await.unwrap();
            tx.insert(order::ActiveModel::from(order)).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
    let grown = format!(
        "{shards}[[shards]]\nname = \"s4\"\nurl = \"{}\"\n\n{group}",
        scratch.url("s4")
    );
    let config = ClusterConfig::from_toml(&grown).unwrap();
    // An instance with the new shard listed connects before it is migrated.
    let early = Cluster::connect(config.clone()).await.unwrap();
    let tx = early.begin::<Customer>(1).await.unwrap();
    tx.commit().await.unwrap();
    drop(early);

    let done = add_shard(config.clone()).await.unwrap();

    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(
        done.buckets.len(),
        64 / 5,
        "s4 takes a fifth of the buckets"
    );
    let cluster = Cluster::connect(config).await.unwrap();
    let all = cluster
        .find::<order::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    assert_eq!(sorted(all), seeded_orders(), "every order, each once");
    let on_s4 = order::Entity::find()
        .all(cluster.connection("s4").unwrap())
        .await
        .unwrap();
    assert!(!on_s4.is_empty(), "s4 holds orders");
    for o in &on_s4 {
        assert_eq!(
            cluster.shard_of_now::<Customer>(&o.customer_id).unwrap(),
            Some("s4")
        );
    }
}

#[tokio::test]
async fn a_fifth_shard_takes_its_share_of_the_buckets() {
    let scratch = Scratch::new("grow");
    let toml = format!(
        "{}[[shards]]\nname = \"s4\"\nurl = \"{}\"\n\n[groups.Customer]\nbuckets = 1024\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n[rebalance]\ncleanup_grace_ms = 0\n",
        scratch
            .cluster_toml(4)
            .split("[groups.Customer]")
            .next()
            .unwrap(),
        scratch.url("s4"),
    );
    let cluster = migrated(&toml).await;
    cluster.refresh_bucket_maps().await.unwrap();
    for order in seeded_orders() {
        let tx = cluster.begin::<Customer>(order.customer_id).await.unwrap();
        tx.insert(order::ActiveModel::from(order)).await.unwrap();
        tx.commit().await.unwrap();
    }

    let done = grow(&cluster).await.unwrap();

    assert_eq!(done.phase, MovePhase::Done);
    assert_eq!(
        done.buckets.len(),
        1024 / 5,
        "s4 takes a fifth of the buckets"
    );
    let all = cluster
        .find::<order::Entity>()
        .scatter()
        .all()
        .await
        .unwrap();
    assert_eq!(sorted(all), seeded_orders(), "every order, each once");
    let on_s4 = order::Entity::find()
        .all(cluster.connection("s4").unwrap())
        .await
        .unwrap();
    for o in &on_s4 {
        assert_eq!(
            cluster.shard_of_now::<Customer>(&o.customer_id).unwrap(),
            Some("s4")
        );
    }
    let mut total = 0;
    for shard in ["s0", "s1", "s2", "s3", "s4"] {
        total += order::Entity::find()
            .all(cluster.connection(shard).unwrap())
            .await
            .unwrap()
            .len();
    }
    assert_eq!(total, seeded_orders().len(), "the old shards were cleaned");
}

#[tokio::test]
async fn ids_are_unique_and_route_to_their_shard() {
    let scratch = Scratch::new("ids");
    let toml = format!(
        "{}\n[ids]\nservers = [\n  {{ name = \"tickets_a\", url = \"{}\" }},\n  {{ name = \"tickets_b\", url = \"{}\" }},\n]\nworker_id = 3\n[ids.sequences.orders]\nblock = 1000\n",
        scratch.cluster_toml(4),
        scratch.url("tickets_a"),
        scratch.url("tickets_b"),
    );
    let cluster = migrated(&toml).await;
    cluster.ids().create_sequence("orders").await.unwrap();

    let issued = ids(&cluster).await.unwrap();

    assert!(issued.id > 0);
    let next = issued.seq.next().await.unwrap();
    assert!(next > issued.id, "{next} after {}", issued.id);
    assert!(
        issued.enc >> 13 > issued.id,
        "the encoded id's sequence part comes from the same sequence"
    );
    assert_eq!(
        (issued.sf >> 12) & 0x3ff,
        3,
        "worker_id in the snowflake's 10 worker bits"
    );
    assert!(cluster.ids().snowflake().unwrap() > issued.sf);
    assert_eq!(issued.u.get_version_num(), 7);
    assert_eq!(
        issued.target,
        cluster.route::<Customer>(&42).await.unwrap(),
        "route_id finds key 42's shard from the id alone"
    );
}

/// shardkit/docs/replicas.md ("Read-your-writes with a session"): a write
/// and its read-back through a session.
#[rustfmt::skip]
async fn read_your_writes(cluster: &Cluster, session: Session) -> shardkit::Result<Option<order::Model>> {
    let tx = cluster.begin::<Customer>(7).await?;
    tx.update(order::ActiveModel { id: Set(1), customer_id: Set(7), total_cents: Set(250) }).await?;
    tx.commit_in(&session).await?;                      // records where the commit landed
    let header = session.to_string();                   // `s1=pg:0/9CD80F8`, for the next request
    let session: Session = header.parse()?;             // in that request, maybe another instance
    let order = cluster.find::<order::Entity>().key(7)
        .consistency(Consistency::at_least(&session))   // a replica past the commit, else the shard
        .one().await?;
    Ok(order)
}

/// On SQLite shards, which have no replicas, a session records nothing and
/// the shard answers: the read sees the write. (The same code against real
/// replicas runs in `tests/tests/replicas.rs` and the `replicas` example.)
#[tokio::test]
async fn a_session_reads_its_own_write() {
    let scratch = Scratch::new("replicas");
    let cluster = migrated(&scratch.cluster_toml(2)).await;
    let tx = cluster.begin::<Customer>(7).await.unwrap();
    tx.insert(order::ActiveModel {
        id: Set(1),
        customer_id: Set(7),
        total_cents: Set(100),
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let session = Session::new();
    let order = read_your_writes(&cluster, session.clone()).await.unwrap();
    assert_eq!(order.map(|o| o.total_cents), Some(250));
    assert!(session.is_empty(), "no replica, no position: {session}");
}

// ---------------------------------------------------------------------------
// The check that the documentation's snippets are the code above.

const THIS_FILE: &str = include_str!("readme.rs");
const THIS_PATH: &str = "examples/tests/readme.rs";

/// The guide's folder, relative to the workspace.
const GUIDE: &str = "shardkit/docs";

/// The workspace's root directory.
fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("examples/ is inside the workspace")
        .to_owned()
}

/// A Markdown file of the documentation.
struct Doc {
    /// Its path from the workspace root, as messages name it.
    path: String,
    text: String,
}

/// README.md, then every chapter of the guide (`shardkit/docs/*.md`), by name.
fn docs() -> Vec<Doc> {
    let root = workspace();
    let mut chapters: Vec<String> = std::fs::read_dir(root.join(GUIDE))
        .unwrap_or_else(|e| panic!("{GUIDE}: {e}"))
        .map(|entry| entry.expect("a directory entry").file_name())
        .filter_map(|name| name.to_str().map(str::to_owned))
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("{GUIDE}/{name}"))
        .collect();
    chapters.sort();
    std::iter::once("README.md".to_owned())
        .chain(chapters)
        .map(|path| Doc {
            text: std::fs::read_to_string(root.join(&path))
                .unwrap_or_else(|e| panic!("{path}: {e}")),
            path,
        })
        .collect()
}

/// A fenced code block of a documentation file.
struct Block {
    /// The file it is in.
    doc: String,
    /// The info string: `rust`, `toml`, ...
    lang: String,
    /// The file's line number of each line of the block, with the line.
    lines: Vec<(usize, String)>,
    /// The file's line number of the opening fence.
    fence: usize,
}

fn blocks_in(doc: &Doc) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in doc.text.lines().enumerate() {
        let number = i + 1;
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) => {
                open = Some(Block {
                    doc: doc.path.clone(),
                    lang: info.trim().to_owned(),
                    lines: Vec::new(),
                    fence: number,
                })
            }
            (Some(_), Some(rest)) if rest.trim().is_empty() => {
                blocks.extend(open.take());
            }
            (Some(block), _) => block.lines.push((number, line.to_owned())),
            (None, None) => {}
        }
    }
    if let Some(block) = open {
        panic!("{}:{}: code block never closed", block.doc, block.fence);
    }
    blocks
}

/// The `lang` blocks of every documentation file, in order.
fn blocks_of(lang: &str) -> Vec<Block> {
    let blocks: Vec<Block> = docs()
        .iter()
        .flat_map(blocks_in)
        .filter(|b| b.lang.split(',').next() == Some(lang))
        .collect();
    assert!(
        !blocks.is_empty(),
        "the documentation has no ```{lang} block"
    );
    blocks
}

/// Where `block`'s lines occur in `haystack` (trimmed lines): each run of
/// non-blank lines contiguous, the runs in order. Otherwise a message naming
/// the first line of the block that is not found.
fn locate(block: &Block, haystack: &[&str]) -> Result<(), String> {
    let mut from = 0;
    for run in block.lines.split(|(_, line)| line.trim().is_empty()) {
        if run.is_empty() {
            continue;
        }
        let matching = |at: usize| {
            run.iter()
                .zip(&haystack[at..])
                .take_while(|((_, want), have)| want.trim() == **have)
                .count()
        };
        match (from..haystack.len()).find(|&at| matching(at) == run.len()) {
            Some(at) => from = at + run.len(),
            None => {
                // Report the line after the longest prefix of this run found.
                let (at, len) = (from..haystack.len())
                    .map(|at| (at, matching(at)))
                    .max_by_key(|&(at, len)| (len, std::cmp::Reverse(at)))
                    .unwrap_or((from, 0));
                let (number, line) = &run[len];
                let context = if len > 0 {
                    format!(
                        " ({THIS_PATH}:{} has `{}` in its place)",
                        at + len + 1,
                        haystack.get(at + len).unwrap_or(&"<end of file>")
                    )
                } else {
                    String::new()
                };
                return Err(format!(
                    "{}:{number}: `{}` (```{} block at line {}) is not in {THIS_PATH}{context}",
                    block.doc,
                    line.trim(),
                    block.lang,
                    block.fence
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn doc_rust_snippets_are_compiled_here() {
    let haystack: Vec<&str> = THIS_FILE.lines().map(str::trim).collect();
    let missing: Vec<String> = blocks_of("rust")
        .iter()
        .filter_map(|block| locate(block, &haystack).err())
        .collect();
    assert!(
        missing.is_empty(),
        "the documentation's rust snippets must be copied verbatim into {THIS_PATH}, where they compile and run:\n{}",
        missing.join("\n")
    );
}

/// The shard a config fragment (say, only `[ids]`) is parsed with, after
/// its own lines so error line numbers stay the fragment's.
const FRAGMENT_SHARDS: &str = "\n[[shards]]\nname = \"s0\"\nurl = \"sqlite://s0.db?mode=rwc\"\n";

/// Whether a TOML text is a whole config: it has `[[shards]]` or a top-level
/// `shards = ...`.
fn declares_shards(text: &str) -> bool {
    let mut top_level = true;
    for line in text.lines().map(str::trim_start) {
        if line.starts_with("[[shards]]") || (top_level && line.starts_with("shards")) {
            return true;
        }
        top_level &= !line.starts_with('[');
    }
    false
}

#[test]
fn doc_toml_snippets_are_valid_configs() {
    let mut wrong = Vec::new();
    for block in blocks_of("toml") {
        let text: String = block.lines.iter().map(|(_, l)| format!("{l}\n")).collect();
        let config = if declares_shards(&text) {
            text.clone()
        } else {
            format!("{text}{FRAGMENT_SHARDS}")
        };
        match ClusterConfig::from_toml(&config) {
            Err(e) => wrong.push(format!(
                "{}:{}: the ```toml block is not a valid shardkit config: {e} (its line 1 is {}:{})",
                block.doc,
                block.fence,
                block.doc,
                block.fence + 1
            )),
            // The documentation says a password never shows in Debug.
            Ok(parsed) => {
                let debug = format!("{parsed:?}");
                if passwords(&text).any(|pw| debug.contains(pw)) {
                    wrong.push(format!(
                        "{}:{}: a URL's password shows in the config's Debug",
                        block.doc, block.fence
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The passwords of the `scheme://user:password@host` URLs in `text`.
fn passwords(text: &str) -> impl Iterator<Item = &str> {
    text.split("://").skip(1).filter_map(|rest| {
        let authority = rest.split(['/', '"', ' ']).next()?;
        let userinfo = authority.rsplit_once('@')?.0;
        Some(userinfo.split_once(':')?.1)
    })
}

#[test]
fn doc_commands_name_example_programs() {
    let bins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/bin");
    let mut named = 0;
    for doc in docs() {
        for (i, line) in doc.text.lines().enumerate() {
            for rest in line.split("--bin ").skip(1) {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-')
                    .collect();
                named += 1;
                assert!(
                    bins.join(format!("{name}.rs")).exists(),
                    "{}:{}: `--bin {name}` is not a program of shardkit-examples",
                    doc.path,
                    i + 1
                );
            }
        }
    }
    assert!(named > 0, "the documentation names no example program");
}

/// CI runs the README's commands: its first code block is the quickstart and
/// the whole test suite, the two commands a fresh clone runs.
#[test]
fn readme_opens_with_the_two_commands() {
    let readme = &docs()[0];
    let first = blocks_in(readme)
        .into_iter()
        .next()
        .expect("README.md has a code block");
    let commands: Vec<&str> = first
        .lines
        .iter()
        .map(|(_, l)| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        commands,
        [
            "cargo run -p shardkit-examples --bin quickstart",
            "cargo test --workspace"
        ],
        "README.md:{}: the first code block",
        first.fence
    );
}

/// Every chapter of the guide is a module of `shardkit::guide`, so rustdoc
/// shows it (`shardkit/src/lib.rs`: `include_str!("../docs/<chapter>.md")`).
#[test]
fn every_chapter_is_in_the_rustdoc_guide() {
    let lib = std::fs::read_to_string(workspace().join("shardkit/src/lib.rs"))
        .expect("shardkit/src/lib.rs");
    for doc in docs().iter().skip(1) {
        let file = doc.path.rsplit('/').next().unwrap_or_default();
        assert!(
            lib.contains(&format!("include_str!(\"../docs/{file}\")")),
            "{}: not included in shardkit/src/lib.rs's `guide` module",
            doc.path
        );
    }
}

/// The link destinations of `text`: inline `](dest)` and definitions
/// `[label]: dest`, with their line numbers.
fn links(text: &str) -> Vec<(usize, &str)> {
    let mut found = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        for rest in line.split("](").skip(1) {
            if let Some(dest) = rest.split(')').next() {
                found.push((i + 1, dest));
            }
        }
        let definition = line.strip_prefix('[').and_then(|l| l.split_once("]: "));
        if let Some((label, dest)) = definition.filter(|(label, _)| !label.contains(['[', ']'])) {
            debug_assert!(!label.is_empty());
            found.push((i + 1, dest.trim()));
        }
    }
    found
}

/// A relative link in the documentation names a file that exists (on
/// GitHub, and in a checkout), whatever its `#anchor`.
#[test]
fn doc_links_name_files_that_exist() {
    let root = workspace();
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in docs() {
        let dir = root
            .join(&doc.path)
            .parent()
            .expect("a file's folder")
            .to_owned();
        for (line, dest) in links(&doc.text) {
            let file = dest.split('#').next().unwrap_or_default();
            if file.is_empty() || file.contains("://") {
                continue;
            }
            checked += 1;
            if !dir.join(file).exists() {
                broken.push(format!("{}:{line}: `{dest}` names no file", doc.path));
            }
        }
    }
    assert!(checked > 0, "no relative link was checked");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn links_are_found_inline_and_in_definitions() {
    assert_eq!(
        links("see [a](a.md#x) and [b][b]\n```\n[c](c.md)\n```\n[b]: b.md\n[d][b]: text\n"),
        vec![(1, "a.md#x"), (5, "b.md")]
    );
}

#[test]
fn whole_configs_are_told_from_fragments() {
    assert!(declares_shards("[[shards]]\nname = \"s0\""));
    assert!(declares_shards("shards = [{ name = \"s0\" }]"));
    assert!(!declares_shards("[ids]\nworker_id = 3"));
    assert!(!declares_shards("[groups.Meter]\nshards = [\"s0\"]"));
}

#[test]
fn passwords_are_found_in_urls() {
    assert_eq!(
        passwords("url = \"postgres://app:secret@10.0.0.5:5432\" x = \"sqlite://a.db\"")
            .collect::<Vec<_>>(),
        vec!["secret"]
    );
}
