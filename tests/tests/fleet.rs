//! The fleet: migrations that fail on one shard and finish on the next run,
//! a migration that lands while a bucket move runs, and reference tables on
//! every shard.

use sea_orm::{ActiveValue::Set, ConnectionTrait};
use sea_orm_migration::prelude::*;
use shardkit::{Cluster, ClusterConfig, JobControl, MigrateOptions, MigrationProgress, ShardError};
use shardkit_tests::{Backend, Proxy, TestDbs, backend_tests};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

backend_tests!(5 =>
    a_failing_migration_leaves_the_others_migrated_and_the_next_run_finishes,
    a_migration_during_a_move_reaches_the_target,
    reference_writes_reach_every_shard_while_one_refuses_and_one_hangs,
    reference_drift_is_repaired_and_a_move_target_gets_the_table,
    a_copy_that_needs_many_rows_is_caught_up_under_a_short_read_timeout,
);

#[derive(shardkit::EntityGroup)]
#[shardkit(key = i64)]
pub struct Writer;

/// A note as the application wrote it before the `memo` migration.
pub mod note {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "notes")]
    #[shardkit(group = super::Writer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub body: String,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The same table after the `memo` migration.
pub mod note_memo {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "notes")]
    #[shardkit(group = super::Writer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub body: String,
        pub memo: Option<String>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

#[derive(shardkit::EntityGroup)]
#[shardkit(key = i64)]
pub struct Buyer;

/// A reference table: a copy on every shard. `rate` is written by one
/// writer per row, counting up, so a reader that sees it go down saw an
/// older version of the table.
pub mod currency {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "currencies")]
    #[shardkit(reference)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub code: String,
        #[sea_orm(unique)]
        pub name: String,
        pub rate: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// A buyer's purchase, joined with its currency on the buyer's shard.
pub mod purchase {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "purchases")]
    #[shardkit(group = super::Buyer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub buyer_id: i64,
        pub currency_code: String,
        pub amount: i64,
        #[sea_orm(belongs_to, from = "currency_code", to = "code")]
        pub currency: BelongsTo<super::currency::Entity>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// The table after a second migration adds `tag`.
pub mod note_tag {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "notes")]
    #[shardkit(group = super::Writer)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub id: i64,
        pub body: String,
        pub memo: Option<String>,
        pub tag: Option<String>,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

const MEMO: &str = "m20261127_000302_notes_memo";

fn base() -> Vec<Box<dyn MigrationTrait>> {
    use shardkit_tests::models::CreateTable;
    let mut all = shardkit_migration::migrations();
    all.push(Box::new(CreateTable(
        "m20261127_000301_notes",
        note::Entity,
    )));
    all.push(Box::new(CreateTable(
        "m20261127_000303_currencies",
        currency::Entity,
    )));
    all.push(Box::new(CreateTable(
        "m20261127_000304_purchases",
        purchase::Entity,
    )));
    all
}

pub struct Before;

#[async_trait::async_trait]
impl MigratorTrait for Before {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        base()
    }
}

pub struct After;

/// Adds a nullable text column to `notes`: one statement, so a failure
/// leaves nothing half done on any backend.
struct AddColumn(&'static str, &'static str);

impl MigrationName for AddColumn {
    fn name(&self) -> &str {
        self.0
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddColumn {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("notes"))
                    .add_column(ColumnDef::new(Alias::new(self.1)).text().null())
                    .to_owned(),
            )
            .await
    }
}

pub struct Tagged;

#[async_trait::async_trait]
impl MigratorTrait for Tagged {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = After::migrations();
        all.push(Box::new(AddColumn("m20261127_000305_notes_tag", "tag")));
        all
    }
}

#[async_trait::async_trait]
impl MigratorTrait for After {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = base();
        all.push(Box::new(AddColumn(MEMO, "memo")));
        all
    }
}

const BUCKETS: u32 = 64;

fn toml(dbs: &TestDbs, schema_wait_ms: u64) -> String {
    toml_through(dbs, schema_wait_ms, &[])
}

/// The config, with shards `through` reached through proxies on the given
/// ports.
fn toml_through(dbs: &TestDbs, schema_wait_ms: u64, through: &[(usize, u16)]) -> String {
    let shards = dbs
        .shards_toml_through(
            5,
            "connect_timeout_secs = 1\nacquire_timeout_secs = 2\n",
            through,
        )
        .replace("max_connections = 4", "max_connections = 2");
    let four = "shards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true";
    format!(
        "{shards}\n[groups.Writer]\nbuckets = {BUCKETS}\n{four}\n\n[groups.Buyer]\nbuckets = {BUCKETS}\n{four}\n\n[rebalance]\nrefresh_ms = 50\ncleanup_grace_ms = 0\nchunk = 50\nschema_wait_ms = {schema_wait_ms}\n\n[read]\ntimeout_ms = 1500\n"
    )
}

async fn connect(toml: &str) -> Cluster {
    Cluster::connect(ClusterConfig::from_toml(toml).unwrap())
        .await
        .unwrap()
}

/// The currency of buyer `buyer`'s first purchase, joined on the buyer's
/// shard (a keyed read through the reference fence).
async fn currency_of(cluster: &Cluster, buyer: i64) -> shardkit::Result<Option<currency::Model>> {
    let rows = cluster
        .find::<purchase::Entity>()
        .key(buyer)
        .find_also_related(currency::Entity)
        .await?;
    Ok(rows.into_iter().next().and_then(|(_, cur)| cur))
}

/// Waits (at most 10 s) until no copy of `table` is behind its source.
async fn caught_up<E: shardkit::ReferenceEntity + 'static>(
    table: &shardkit::reference::Reference<E>,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = table.status().await.unwrap();
        if status.behind().is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn exec(cluster: &Cluster, shard: &str, sql: &str) {
    let db = cluster.connection(shard).unwrap();
    db.execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql} on {shard}: {e}"));
}

async fn a_failing_migration_leaves_the_others_migrated_and_the_next_run_finishes(
    dbs: &mut TestDbs,
) {
    let cluster = connect(&toml(dbs, 60_000)).await;
    // Cancelled before it starts, on a fleet never migrated: nothing runs
    // anywhere, and the report comes back.
    let stop = shardkit::CancellationToken::new();
    stop.cancel();
    let report = cluster
        .migrate_with::<Before>(MigrateOptions::new().control(JobControl::new().cancel_on(stop)))
        .await
        .unwrap();
    assert!(
        report
            .databases
            .iter()
            .all(|d| d.ran.is_empty() && d.error.is_none()),
        "{report}"
    );
    assert_eq!(report.behind().len(), 5, "{report}");

    cluster.migrate::<Before>().await.unwrap();
    let all: Vec<String> = (0..5).map(|i| format!("s{i}")).collect();

    // s2 got the column by hand: the migration conflicts there.
    exec(&cluster, "s2", "ALTER TABLE notes ADD COLUMN memo TEXT").await;
    let seen: Arc<Mutex<Vec<MigrationProgress>>> = Arc::default();
    let control = JobControl::new().on_progress({
        let seen = seen.clone();
        move |p: &MigrationProgress| seen.lock().unwrap().push(p.clone())
    });
    let report = cluster
        .migrate_with::<After>(MigrateOptions::new().concurrency(2).control(control))
        .await
        .unwrap();
    let failed: Vec<&str> = report.failed().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(failed, ["s2"], "{report}");
    let s2 = &report.databases[2];
    let error = s2.error.as_deref().unwrap();
    let cause = match dbs.backend {
        Backend::Sqlite => "duplicate column name: memo",
        Backend::Postgres => "column \"memo\" of relation \"notes\" already exists",
        Backend::MySql => "Duplicate column name 'memo'",
    };
    assert!(error.contains(cause), "{error}");
    assert_eq!(s2.pending, [MEMO]);
    assert!(s2.ran.is_empty());
    for d in report.databases.iter().filter(|d| d.name != "s2") {
        assert_eq!(d.ran, [MEMO], "{report}");
        assert!(d.pending.is_empty() && d.error.is_none(), "{report}");
    }
    assert!(report.to_string().contains("<- failed: "), "{report}");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 5);
    assert_eq!(
        seen.last().map(|p| (p.done, p.total, p.failed)),
        Some((5, 5, 1))
    );
    let mut finished: Vec<String> = seen.iter().map(|p| p.last.clone()).collect();
    finished.sort();
    assert_eq!(finished, all);

    // `migrate` names the shard and the driver's cause, once.
    let err = cluster.migrate::<After>().await.unwrap_err();
    assert!(
        matches!(&err, ShardError::Migration { shard, .. } if shard == "s2"),
        "{err}"
    );
    let text = err.report().to_string();
    assert_eq!(text.matches(cause).count(), 1, "{text}");

    // Status shows the drift: s2 is one migration behind the others.
    let status = cluster.migration_status::<After>().await.unwrap();
    let behind: Vec<&str> = status.behind().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(behind, ["s2"]);
    let versions = status.versions();
    assert_eq!(versions.len(), 2, "{versions:?}");
    assert!(
        versions.contains(&(Some(MEMO), vec!["s0", "s1", "s3", "s4"])),
        "{versions:?}"
    );
    // And so does shardctl, with exit code 1.
    let mut out = Vec::new();
    let registry = shardkit::cli::Registry::new().migrator::<After>();
    let code = shardkit::cli::run_with(
        ["shardctl", "--json", "migrate", "status"],
        ClusterConfig::from_toml(&toml(dbs, 60_000)).unwrap(),
        registry,
        &mut out,
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(code, 1, "{json:#}");
    assert_eq!(json["databases"][2]["behind"], true);
    assert_eq!(json["versions"].as_array().unwrap().len(), 2, "{json:#}");

    // The conflict removed, the next run finishes s2 and runs nothing again
    // elsewhere.
    exec(&cluster, "s2", "ALTER TABLE notes DROP COLUMN memo").await;
    let mut out = Vec::new();
    let registry = shardkit::cli::Registry::new().migrator::<After>();
    let code = shardkit::cli::run_with(
        ["shardctl", "--json", "migrate", "up", "--concurrency", "1"],
        ClusterConfig::from_toml(&toml(dbs, 60_000)).unwrap(),
        registry,
        &mut out,
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(code, 0, "{json:#}");
    for d in json["databases"].as_array().unwrap() {
        let ran: Vec<&str> = d["ran"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            ran,
            if d["name"] == "s2" {
                vec![MEMO]
            } else {
                vec![]
            },
            "{json:#}"
        );
    }
    assert!(
        cluster
            .migration_status::<After>()
            .await
            .unwrap()
            .is_current()
    );
}

const NOTES: i64 = 200;

async fn a_migration_during_a_move_reaches_the_target(dbs: &mut TestDbs) {
    let _turn = FAILPOINTS.lock().await;
    let cluster = connect(&toml(dbs, 30_000)).await;
    cluster.migrate::<Before>().await.unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    for id in 1..=NOTES {
        cluster
            .transaction::<Writer, _, _>(id, |tx| async move {
                tx.insert(note::ActiveModel {
                    id: Set(id),
                    body: Set("0".to_owned()),
                })
                .await
            })
            .await
            .unwrap();
    }
    let quarter: Vec<u32> = (0..BUCKETS).filter(|b| b % 4 == 1).collect();

    // An instance that does not wait: its move stops at once with the
    // table and the shard that lack the entity's column.
    let impatient = connect(&toml(dbs, 0)).await;
    impatient.refresh_bucket_maps().await.unwrap();
    let mover = impatient
        .rebalance::<Writer>()
        .unwrap()
        .entity::<note_memo::Entity>();
    let plan = mover.plan_buckets(quarter.clone(), "s4").await.unwrap();
    let started = mover.start(&plan).await.unwrap();
    let err = mover.run(started.id).await.unwrap_err();
    assert!(matches!(err, ShardError::Rebalance { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("table `notes` on shard `s") && text.contains("lacks column(s) `memo`"),
        "{text}"
    );
    drop(impatient);

    // Writers change every note meanwhile: bodies first, and memos once
    // the migration has landed (what the move must not lose).
    let migrated = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let memos: Arc<Mutex<std::collections::BTreeMap<i64, String>>> = Arc::default();
    let mut writers = Vec::new();
    for w in 0..8i64 {
        let (c, migrated, stop, memos) = (
            cluster.clone(),
            migrated.clone(),
            stop.clone(),
            memos.clone(),
        );
        writers.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                // Each writer its own notes: a memo recorded after its commit is
                // the note's last.
                let id = 1 + (n * 8 + w) % NOTES;
                let with_memo = migrated.load(Ordering::SeqCst);
                let memo = format!("{w}-{n}");
                let written = c
                    .transaction::<Writer, _, _>(id, |tx| {
                        let memo = memo.clone();
                        async move {
                            if with_memo {
                                tx.update(note_memo::ActiveModel {
                                    id: Set(id),
                                    body: Set(n.to_string()),
                                    memo: Set(Some(memo)),
                                })
                                .await
                                .map(|_| ())
                            } else {
                                tx.update(note::ActiveModel {
                                    id: Set(id),
                                    body: Set(n.to_string()),
                                })
                                .await
                                .map(|_| ())
                            }
                        }
                    })
                    .await;
                match written {
                    Ok(()) if with_memo => {
                        memos.lock().unwrap().insert(id, memo);
                    }
                    Ok(()) => {}
                    // The cut-over's fence, retried by the next round.
                    Err(e) if e.retry() != shardkit::Retry::Never => {}
                    Err(e) => panic!("writer {w}: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }

    // This instance's mover waits for the migration, which lands while it
    // waits, on every shard (the target too).
    let mover = cluster
        .rebalance::<Writer>()
        .unwrap()
        .entity::<note_memo::Entity>();
    let moving = tokio::spawn({
        let mover = mover.clone();
        async move { mover.run(started.id).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !moving.is_finished(),
        "the move did not wait for the migration"
    );
    let report = cluster.migrate::<After>().await.unwrap();
    assert!(report.databases.iter().all(|d| d.ran == [MEMO]), "{report}");
    migrated.store(true, Ordering::SeqCst);
    let done = tokio::time::timeout(Duration::from_secs(120), moving)
        .await
        .expect("the move did not finish")
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    assert_eq!(done.phase, shardkit::rebalance::MovePhase::Done, "{done:?}");

    // Every memo written is where reads find it, and the moved notes are
    // on the target, with their memos.
    cluster.refresh_bucket_maps().await.unwrap();
    let memos = memos.lock().unwrap().clone();
    assert!(!memos.is_empty());
    let mut on_target = 0;
    for (id, memo) in &memos {
        let row = cluster
            .find::<note_memo::Entity>()
            .key(*id)
            .one()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.memo.as_deref(), Some(memo.as_str()), "note {id}");
        if cluster.shard_of::<Writer>(id).await.unwrap() == "s4" {
            on_target += 1;
        }
    }
    assert!(on_target > 0);
    let s4 = cluster.connection("s4").unwrap();
    let rows: Vec<note_memo::Model> = <note_memo::Entity as sea_orm::EntityTrait>::find()
        .all(s4)
        .await
        .unwrap();
    let mut owned = 0;
    for id in 1..=NOTES {
        owned += usize::from(cluster.shard_of::<Writer>(&id).await.unwrap() == "s4");
    }
    assert_eq!(rows.len(), owned);
    for row in &rows {
        if let Some(memo) = memos.get(&row.id) {
            assert_eq!(row.memo.as_ref(), Some(memo), "note {} on s4", row.id);
        }
    }

    // A mover built without the column stops instead of dropping it.
    let old = cluster
        .rebalance::<Writer>()
        .unwrap()
        .entity::<note::Entity>();
    let back: Vec<u32> = quarter.iter().copied().take(4).collect();
    let plan = old.plan_buckets(back.clone(), "s0").await.unwrap();
    let started = old.start(&plan).await.unwrap();
    let err = old.run(started.id).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("has column(s) `memo` that the mover's entity lacks"),
        "{text}"
    );
    old.abort(started.id).await.unwrap();

    // A column that lands after the copy: a mover without it has copied
    // and replayed rows without its values. Its cut-over stops and sends
    // the move back to copying, and a mover with the column copies again.
    let old = cluster
        .rebalance::<Writer>()
        .unwrap()
        .entity::<note_memo::Entity>();
    let plan = old.plan_buckets(back, "s0").await.unwrap();
    let started = old.start(&plan).await.unwrap();
    fail::cfg(
        "shardkit::rebalance::verified",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    let stopped = old.run(started.id).await;
    fail::remove("shardkit::rebalance::verified");
    assert!(stopped.is_err());
    cluster.migrate::<Tagged>().await.unwrap();
    let mut tags = std::collections::BTreeMap::new();
    for id in 1..=NOTES {
        if cluster.shard_of::<Writer>(&id).await.unwrap() != "s4" {
            continue;
        }
        let tag = format!("tag-{id}");
        cluster
            .transaction::<Writer, _, _>(id, |tx| {
                let tag = tag.clone();
                async move {
                    tx.update_many::<note_tag::Entity>()
                        .col_expr(note_tag::Column::Tag, sea_orm::sea_query::Expr::value(tag))
                        .exec()
                        .await
                }
            })
            .await
            .unwrap();
        tags.insert(id, tag);
    }
    let err = old.run(started.id).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("has column(s) `tag` that the mover's entity lacks"),
        "{err}"
    );
    let status = old.status(started.id).await.unwrap();
    assert_eq!(
        status.phase,
        shardkit::rebalance::MovePhase::Copying,
        "{status:?}"
    );
    let new = cluster
        .rebalance::<Writer>()
        .unwrap()
        .entity::<note_tag::Entity>();
    let done = new.run(started.id).await.unwrap();
    assert_eq!(done.phase, shardkit::rebalance::MovePhase::Done, "{done:?}");
    cluster.refresh_bucket_maps().await.unwrap();
    let mut moved = 0;
    for (id, tag) in &tags {
        let row = cluster
            .find::<note_tag::Entity>()
            .key(*id)
            .one()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.tag.as_deref(), Some(tag.as_str()), "note {id}");
        moved += usize::from(cluster.shard_of::<Writer>(id).await.unwrap() == "s0");
    }
    assert!(moved > 0);
}

/// Failpoints are process-wide: the scenarios that arm one, write
/// reference tables or move buckets take turns.
static FAILPOINTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CURRENCIES: i64 = 12;
const BUYERS: i64 = 200;

fn code(i: i64) -> String {
    format!("C{:02}", i % CURRENCIES)
}

/// What buyer `b` bought in: `C10` and `C11` are in no purchase.
fn bought(b: i64) -> String {
    code(b % 10)
}

async fn seed_buyers(cluster: &Cluster) {
    let currencies = cluster.reference::<currency::Entity>();
    let first = currencies
        .insert_many((0..CURRENCIES).map(|i| currency::Model {
            code: code(i),
            name: format!("currency {i}"),
            rate: 0,
        }))
        .await
        .unwrap();
    assert_eq!(first.version, 1);
    assert!(first.behind.is_empty(), "{first:?}");
    for b in 1..=BUYERS {
        cluster
            .transaction::<Buyer, _, _>(b, |tx| async move {
                tx.insert(purchase::ActiveModel {
                    buyer_id: Set(b),
                    currency_code: Set(bought(b)),
                    amount: Set(b * 10),
                })
                .await
            })
            .await
            .unwrap();
    }
}

/// 4 writers change the currencies (each its own rows, rates counting up)
/// through two instances while 8 readers on both read purchases joined with
/// their currency, and read the table itself; one shard refuses connections
/// for a while and another hangs (on servers). No reader ever sees a rate
/// go down; afterwards every copy is at the source's version with its rows,
/// and no connection is left behind.
async fn reference_writes_reach_every_shard_while_one_refuses_and_one_hangs(dbs: &mut TestDbs) {
    let _turn = FAILPOINTS.lock().await;
    let plain = toml(dbs, 60_000);
    let b = connect(&plain).await;
    b.migrate::<Before>().await.unwrap();
    seed_buyers(&b).await;
    let servers = dbs.backend != Backend::Sqlite;
    let target = dbs.backend.server_address().unwrap_or_default();
    let (refusing, hanging) = if servers {
        (
            Some(Proxy::start(target.clone()).await),
            Some(Proxy::start(target.clone()).await),
        )
    } else {
        (None, None)
    };
    let through: Vec<(usize, u16)> = [(1, &refusing), (2, &hanging)]
        .into_iter()
        .filter_map(|(i, p)| p.as_ref().map(|p| (i, p.port)))
        .collect();
    let a = connect(&toml_through(dbs, 60_000, &through)).await;
    let before = dbs.server_connections().await;

    let stop = Arc::new(AtomicBool::new(false));
    let behind_seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..4i64 {
        let (c, stop, behind_seen) = (
            if w % 2 == 0 { a.clone() } else { b.clone() },
            stop.clone(),
            behind_seen.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let currencies = c.reference::<currency::Entity>();
            let mut rate = 0;
            while !stop.load(Ordering::SeqCst) {
                rate += 1;
                // Rows of this writer only: C(w), C(w+4), C(w+8).
                let rows = (0..CURRENCIES / 4).map(|k| currency::Model {
                    code: code(w + 4 * k),
                    name: format!("currency {}", w + 4 * k),
                    rate,
                });
                match currencies.upsert_many(rows).await {
                    Ok(write) => {
                        if !write.behind.is_empty() {
                            behind_seen.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    // The source is s0, never faulty: a write fails only
                    // when it is refused, which none of these is.
                    Err(e) => panic!("writer {w}: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            rate
        }));
    }
    let backwards = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut readers = Vec::new();
    for r in 0..8i64 {
        let (c, stop, backwards, reads) = (
            if r % 2 == 0 { a.clone() } else { b.clone() },
            stop.clone(),
            backwards.clone(),
            reads.clone(),
        );
        readers.push(tokio::spawn(async move {
            // One handle per reader: its reads take the shards in turn.
            let table = c.reference::<currency::Entity>();
            let mut seen: std::collections::BTreeMap<String, i64> = Default::default();
            let mut check = |cur: &currency::Model| {
                let last = seen.entry(cur.code.clone()).or_default();
                if cur.rate < *last {
                    backwards.fetch_add(1, Ordering::SeqCst);
                }
                *last = std::cmp::max(*last, cur.rate);
            };
            let mut n = r * 7919;
            while !stop.load(Ordering::SeqCst) {
                n = (n * 1_103_515_245 + 12_345) % 2_147_483_648;
                let buyer = n % BUYERS + 1;
                if n % 8 == 0 {
                    if let Ok(all) = table.all().await {
                        assert_eq!(all.len() as i64, CURRENCIES);
                        all.iter().for_each(&mut check);
                        reads.fetch_add(1, Ordering::SeqCst);
                    }
                    continue;
                }
                // A shard that refuses or hangs fails the read; the
                // others go on.
                if let Ok(rows) = c
                    .find::<purchase::Entity>()
                    .key(buyer)
                    .find_also_related(currency::Entity)
                    .await
                {
                    let (p, cur) = &rows[0];
                    let cur = cur
                        .as_ref()
                        .expect("the purchase's currency is on its shard");
                    assert_eq!(cur.code, p.currency_code);
                    check(cur);
                    reads.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }

    tokio::time::sleep(Duration::from_millis(500)).await;
    if let (Some(refusing), Some(hanging)) = (&refusing, &hanging) {
        refusing.kill();
        hanging.freeze();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        hanging.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = Proxy::start_on(refusing.port, target.clone()).await;
        let h = Proxy::start_on(hanging.port, target.clone()).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::SeqCst);
        let mut last_rates = Vec::new();
        for t in tasks.drain(..) {
            last_rates.push(t.await.unwrap());
        }
        for t in readers.drain(..) {
            t.await.unwrap();
        }
        assert!(
            behind_seen.load(Ordering::SeqCst) > 0,
            "no write found a shard down"
        );
        std::mem::forget((r, h));
    } else {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks.drain(..) {
            t.await.unwrap();
        }
        for t in readers.drain(..) {
            t.await.unwrap();
        }
    }
    assert_eq!(
        backwards.load(Ordering::SeqCst),
        0,
        "a reader saw a rate go down"
    );
    assert!(
        reads.load(Ordering::SeqCst) > 100,
        "{} reads",
        reads.load(Ordering::SeqCst)
    );

    // Every copy reaches the source's version (the background catch-up, or
    // this call), with the source's rows.
    let currencies = a.reference::<currency::Entity>();
    let status = currencies.catch_up().await.unwrap();
    assert!(status.behind().is_empty(), "{status:?}");
    let version = status.source.unwrap();
    assert!(
        status.copies.iter().all(|c| c.version == Ok(version)),
        "{status:?}"
    );
    let report = currencies.verify(false).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
    assert!(report.copies.iter().all(|c| c.matches), "{report:?}");
    assert_eq!(report.rows as i64, CURRENCIES);

    assert!(version > 50, "only {version} versions written");
    // A copy set back (a restore of that shard, by hand here) is noticed by
    // the background pass and brought to the source's rows and version.
    exec(
        &a,
        "s3",
        "UPDATE shardkit_reference_versions SET version = 1 WHERE tbl = 'currencies'",
    )
    .await;
    exec(&a, "s3", "UPDATE currencies SET name = code").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = currencies.status().await.unwrap();
        if status.copies.iter().all(|c| c.version == Ok(version)) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(currencies.verify(false).await.unwrap().is_consistent());

    drop(currencies);
    drop(a);
    drop(refusing);
    drop(hanging);
    dbs.assert_connections_settle(before).await;
}

/// A row changed and a row deleted on one shard's copy, a row added on
/// another's: verify finds each, shardctl repairs them; a shard whose copy
/// was lost gets the table from a bucket move before it takes buckets, and
/// a transaction on a key reads its currency on the key's shard.
async fn reference_drift_is_repaired_and_a_move_target_gets_the_table(dbs: &mut TestDbs) {
    let _turn = FAILPOINTS.lock().await;
    let cluster = connect(&toml(dbs, 60_000)).await;
    cluster.migrate::<Before>().await.unwrap();
    cluster.refresh_bucket_maps().await.unwrap();
    seed_buyers(&cluster).await;
    let currencies = cluster.reference::<currency::Entity>();
    let update = currencies
        .update(currency::Model {
            code: code(3),
            name: "renamed".to_owned(),
            rate: 7,
        })
        .await
        .unwrap();
    assert_eq!(update.version, 2);
    // Refused writes change nothing, and say why.
    let err = currencies
        .insert(currency::Model {
            code: code(3),
            name: "again".to_owned(),
            rate: 0,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ShardError::Reference {
                table: "currencies",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("`C03`"), "{err}");
    let err = currencies
        .delete(currency::Model {
            code: "XXX".to_owned(),
            name: String::new(),
            rate: 0,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ShardError::Reference { .. }), "{err}");
    assert_eq!(currencies.version().await.unwrap(), 2);

    exec(
        &cluster,
        "s2",
        "UPDATE currencies SET name = 'drifted' WHERE code = 'C03'",
    )
    .await;
    exec(&cluster, "s2", "DELETE FROM currencies WHERE code = 'C11'").await;
    exec(
        &cluster,
        "s3",
        "INSERT INTO currencies (code, name, rate) VALUES ('ZZZ', 'stray', 0)",
    )
    .await;
    let report = currencies.verify(false).await.unwrap();
    assert!(!report.is_consistent());
    let by: std::collections::BTreeMap<&str, &shardkit::reference::CopyReport> = report
        .copies
        .iter()
        .map(|c| (c.shard.as_str(), c))
        .collect();
    assert_eq!(by["s2"].differing, ["C03"]);
    assert_eq!(by["s2"].missing, ["C11"]);
    assert_eq!(by["s3"].extra, ["ZZZ"]);
    assert!(by["s1"].matches && by["s4"].matches);
    assert!(!by["s2"].matches && !by["s3"].matches);

    let registry = || {
        shardkit::cli::Registry::new()
            .migrator::<Before>()
            .reference::<currency::Entity>()
    };
    let shardctl = |args: &'static [&'static str]| {
        let config = ClusterConfig::from_toml(&toml(dbs, 60_000)).unwrap();
        async move {
            let mut out = Vec::new();
            let argv = ["shardctl", "--json"]
                .into_iter()
                .chain(args.iter().copied());
            let code = shardkit::cli::run_with(argv, config, registry(), &mut out).await;
            let json: serde_json::Value = serde_json::from_slice(&out)
                .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)));
            (code, json)
        }
    };
    let (exit, json) = shardctl(&["reference", "verify"]).await;
    assert_eq!(exit, 1, "{json:#}");
    let (exit, json) = shardctl(&["reference", "verify", "currencies", "--repair"]).await;
    assert_eq!(exit, 0, "{json:#}");
    assert_eq!(json[0]["copies"][1]["repaired"], true, "{json:#}");
    let report = currencies.verify(false).await.unwrap();
    assert!(report.is_consistent(), "{report:?}");
    let (exit, json) = shardctl(&["reference", "status"]).await;
    assert_eq!(exit, 0, "{json:#}");
    assert_eq!(json[0]["source"], 2, "{json:#}");

    // A writer dies after the source committed, before any copy: the
    // background catch-up (of any instance that registered the table; here
    // both) brings every copy up, and a second instance reads the write.
    fail::cfg(
        "shardkit::reference::after_source",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    let died = currencies
        .upsert(currency::Model {
            code: code(4),
            name: "after a crash".to_owned(),
            rate: 9,
        })
        .await;
    fail::remove("shardkit::reference::after_source");
    assert!(died.is_err());
    let other = connect(&toml(dbs, 60_000)).await;
    let theirs = other.reference::<currency::Entity>();
    assert_eq!(theirs.version().await.unwrap(), 3);
    caught_up(&theirs).await;
    let row = theirs
        .read(<currency::Entity as sea_orm::EntityTrait>::find_by_id(
            code(4),
        ))
        .await
        .unwrap();
    assert_eq!(row[0].name, "after a crash");
    drop((theirs, other));
    // A row deleted and its unique name taken by a new one: a copy that
    // still holds the old row gets the new one once the old one is gone
    // (deletes before writes), instead of a unique violation for good.
    currencies
        .insert(currency::Model {
            code: "NEW".to_owned(),
            name: "a taken name".to_owned(),
            rate: 1,
        })
        .await
        .unwrap();
    exec(&cluster, "s2", "DELETE FROM currencies WHERE code = 'NEW'").await;
    exec(
        &cluster,
        "s2",
        "INSERT INTO currencies (code, name, rate) VALUES ('OLD', 'a taken name', 0)",
    )
    .await;
    let report = currencies.verify(true).await.unwrap();
    let s2 = report.copies.iter().find(|c| c.shard == "s2").unwrap();
    assert_eq!(
        (s2.missing.as_slice(), s2.extra.as_slice()),
        (["NEW".to_owned()].as_slice(), ["OLD".to_owned()].as_slice())
    );
    assert!(s2.repaired && s2.error.is_none(), "{s2:?}");
    assert!(currencies.verify(false).await.unwrap().is_consistent());
    currencies
        .delete(currency::Model {
            code: "NEW".to_owned(),
            name: String::new(),
            rate: 0,
        })
        .await
        .unwrap();
    // A name passed on: C01 gave up `currency 1`, then C00 took it. A copy
    // still at the old names is repaired although C00, written first,
    // meets C01's old name: it is written again after C01.
    for (i, name) in [(1, "freed"), (0, "currency 1")] {
        currencies
            .update(currency::Model {
                code: code(i),
                name: name.to_owned(),
                rate: 0,
            })
            .await
            .unwrap();
    }
    exec(
        &cluster,
        "s2",
        "UPDATE currencies SET name = 'currency 0' WHERE code = 'C00'",
    )
    .await;
    exec(
        &cluster,
        "s2",
        "UPDATE currencies SET name = 'currency 1' WHERE code = 'C01'",
    )
    .await;
    let report = currencies.verify(true).await.unwrap();
    let s2 = report.copies.iter().find(|c| c.shard == "s2").unwrap();
    assert_eq!(s2.differing, ["C00", "C01"]);
    assert!(s2.repaired && s2.error.is_none(), "{s2:?}");
    assert!(currencies.verify(false).await.unwrap().is_consistent());

    // s4 lost its copy (a shard added to the fleet has none): a move brings
    // the table there before the shard takes buckets.
    exec(&cluster, "s4", "DELETE FROM currencies").await;
    exec(&cluster, "s4", "DELETE FROM shardkit_reference_versions").await;
    let mover = cluster
        .rebalance::<Buyer>()
        .unwrap()
        .entity::<purchase::Entity>();
    let quarter: Vec<u32> = (0..BUCKETS).filter(|b| b % 4 == 1).collect();
    let plan = mover.plan_buckets(quarter, "s4").await.unwrap();
    let started = mover.start(&plan).await.unwrap();
    let done = mover.run(started.id).await.unwrap();
    assert_eq!(done.phase, shardkit::rebalance::MovePhase::Done);
    cluster.refresh_bucket_maps().await.unwrap();
    let s4 = cluster.connection("s4").unwrap();
    let copy: Vec<currency::Model> = <currency::Entity as sea_orm::EntityTrait>::find()
        .all(s4)
        .await
        .unwrap();
    assert_eq!(copy.len() as i64, CURRENCIES);
    let mut moved = 0;
    for buyer in 1..=BUYERS {
        let on_s4 = cluster.shard_of::<Buyer>(&buyer).await.unwrap() == "s4";
        moved += usize::from(on_s4);
        let cur = currency_of(&cluster, buyer).await.unwrap();
        let cur = cur.as_ref().expect("currency on the buyer's shard");
        assert_eq!(cur.code, bought(buyer));
        if buyer % 10 == 3 {
            assert_eq!(cur.name, "renamed");
        }
    }
    assert!(moved > 0);
    // Inside a transaction, the join reads the key's shard's copy.
    let joined = cluster
        .transaction::<Buyer, _, _>(3, |tx| async move {
            tx.find::<purchase::Entity>()
                .find_also_related(currency::Entity)
                .await
        })
        .await
        .unwrap();
    assert_eq!(
        joined[0].1.as_ref().map(|c| c.name.as_str()),
        Some("renamed")
    );
    // The copy on a buyer's shard set back (a restore of that shard, by
    // hand) while the instance knows it to be new: the keyed read that
    // joins it takes the instance's word before the read, and the version
    // read after it refuses the older rows instead of returning them. (No
    // background pass meanwhile; one under way when the failpoint is set
    // may still bring the copy back: then it is set back again.)
    fail::cfg(
        "shardkit::reference::no_pass",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    // Removed however the scenario ends: a failed assertion must not stop
    // the next backend's passes.
    struct Removed(&'static str);
    impl Drop for Removed {
        fn drop(&mut self) {
            fail::remove(self.0);
        }
    }
    let no_pass = Removed("shardkit::reference::no_pass");
    // A buyer of the renamed currency whose shard holds a copy, not the
    // source (s0).
    let mut buyer = 3;
    while cluster.shard_of::<Buyer>(&buyer).await.unwrap() == "s0" {
        buyer += 10;
    }
    assert!(buyer <= BUYERS, "every buyer of C03 is on s0");
    let shard = cluster.shard_of::<Buyer>(&buyer).await.unwrap().to_owned();
    let source = currencies.version().await.unwrap();
    let mut refused = None;
    for _ in 0..3 {
        exec(
            &cluster,
            &shard,
            "UPDATE shardkit_reference_versions SET version = 1 WHERE tbl = 'currencies'",
        )
        .await;
        exec(&cluster, &shard, "UPDATE currencies SET name = LOWER(code)").await;
        match currency_of(&cluster, buyer).await {
            Err(e) => {
                refused = Some(e);
                break;
            }
            Ok(read) => {
                let now = currencies.status().await.unwrap();
                let copy = now.copies.iter().find(|c| c.shard == shard).unwrap();
                assert_eq!(
                    copy.version,
                    Ok(source),
                    "the set-back copy was read: {read:?}"
                );
            }
        }
    }
    let refused = refused.expect("a pass brought the copy back three times");
    assert!(
        matches!(
            &refused,
            ShardError::ReferenceBehind { table: "currencies", shard: s, have: 1, need }
                if *s == shard && *need == source
        ),
        "{refused:?}"
    );
    assert_eq!(
        refused.to_string(),
        format!(
            "the copy of reference table `currencies` on `{shard}` is at version 1, older than version {source} this instance has read"
        )
    );
    assert_eq!(
        refused.retry(),
        shardkit::Retry::After(Duration::from_secs(1))
    );
    drop(no_pass);
    // The next pass brings the copy back, and the read goes through.
    caught_up(&currencies).await;
    let cur = currency_of(&cluster, buyer).await.unwrap();
    assert_eq!(cur.map(|c| c.name), Some("renamed".to_owned()));
    assert!(
        currencies
            .explain(&<currency::Entity as sea_orm::EntityTrait>::find())
            .starts_with("reference `currencies` on shard `s")
    );
    // A copy a constraint holds back: the source deletes a currency only
    // the buyer's purchase on `shard` uses, and the copy's delete is refused
    // by the purchase's foreign key. The first read that finds the copy
    // behind runs its catch-up and gets the refusal; a read in the second
    // after gets `ReferenceBehind` at once, without a catch-up of its own
    // (a stuck copy must not make every read run one and hold a connection
    // waiting for the others). Once the purchase lets go, the background
    // pass catches the copy up and the read goes through.
    let one_off = currency::Model {
        code: "ZZZ".to_owned(),
        name: "one-off".to_owned(),
        rate: 1,
    };
    currencies.insert(one_off.clone()).await.unwrap();
    caught_up(&currencies).await;
    let uses = |code: &str| {
        format!("UPDATE purchases SET currency_code = '{code}' WHERE buyer_id = {buyer}")
    };
    exec(&cluster, &shard, &uses("ZZZ")).await;
    fail::cfg(
        "shardkit::reference::no_pass",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    let no_pass = Removed("shardkit::reference::no_pass");
    let gone = currencies.delete(one_off).await.unwrap();
    assert!(gone.behind.iter().any(|(s, _)| *s == shard), "{gone:?}");
    let first = currency_of(&cluster, buyer).await.unwrap_err();
    assert!(
        !matches!(first, ShardError::ReferenceBehind { .. }),
        "the first read runs the catch-up and gets its refusal: {first:?}"
    );
    let second = currency_of(&cluster, buyer).await.unwrap_err();
    assert!(
        matches!(
            &second,
            ShardError::ReferenceBehind { table: "currencies", shard: s, .. } if *s == shard
        ),
        "{second:?}"
    );
    drop(no_pass);
    exec(&cluster, &shard, &uses(&bought(buyer))).await;
    caught_up(&currencies).await;
    let cur = currency_of(&cluster, buyer).await.unwrap();
    assert_eq!(cur.map(|c| c.code), Some(bought(buyer)));
    // A copy that never had a version (a shard just added, its rows as a
    // restore left them): an instance that starts then, having seen no
    // version yet, does not read it as the table. Its read catches the copy
    // up first (no background pass meanwhile).
    fail::cfg(
        "shardkit::reference::no_pass",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    let no_pass = Removed("shardkit::reference::no_pass");
    exec(
        &cluster,
        &shard,
        "UPDATE shardkit_reference_versions SET version = 0 WHERE tbl = 'currencies'",
    )
    .await;
    exec(&cluster, &shard, "UPDATE currencies SET name = LOWER(code)").await;
    // Such an instance while the source refuses connections, or accepts
    // them and never answers: its read waits for the source at most half
    // the read's timeout, then reads the copy as it is (the source cannot
    // say it has versions), instead of failing. (The source is the control
    // database too: a cleanup grace of a minute keeps the bucket map read
    // at connect good for the read.)
    if let Some(target) = dbs.backend.server_address() {
        for hangs in [false, true] {
            let proxy = Proxy::start(target.clone()).await;
            let config = toml_through(dbs, 60_000, &[(0, proxy.port)])
                .replace("cleanup_grace_ms = 0", "cleanup_grace_ms = 60000");
            let through = connect(&config).await;
            if hangs {
                proxy.freeze();
            } else {
                proxy.kill();
            }
            let cur = currency_of(&through, buyer)
                .await
                .unwrap_or_else(|e| panic!("source hangs: {hangs}: {}", e.report()));
            assert_eq!(
                cur.map(|c| c.name),
                Some(bought(buyer).to_lowercase()),
                "source hangs: {hangs}"
            );
        }
    }
    let starting = connect(&toml(dbs, 60_000)).await;
    let cur = currency_of(&starting, buyer).await.unwrap();
    assert_eq!(cur.map(|c| c.name), Some("renamed".to_owned()));
    drop((no_pass, starting));
    // The source (s0) replaced by an empty, migrated database: an instance
    // that starts then takes no write of the table (it would be version 1
    // with one row, and every copy would be set back to it, its other rows
    // deleted), says why, and every copy keeps its rows.
    let copy_rows = |shard: &'static str| {
        let cluster = cluster.clone();
        async move {
            <currency::Entity as sea_orm::EntityTrait>::find()
                .all(cluster.connection(shard).unwrap())
                .await
                .unwrap()
                .len()
        }
    };
    let held = copy_rows("s1").await;
    assert!(held > 0);
    // (No background pass: one would tell `cluster` the source is at 0.)
    fail::cfg(
        "shardkit::reference::no_pass",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    let no_pass = Removed("shardkit::reference::no_pass");
    exec(&cluster, "s0", "DELETE FROM purchases").await;
    exec(&cluster, "s0", "DELETE FROM currencies").await;
    exec(&cluster, "s0", "DELETE FROM shardkit_reference_versions").await;
    let fresh = connect(&toml(dbs, 60_000)).await;
    let refused = fresh
        .reference::<currency::Entity>()
        .insert(currency::Model {
            code: "NEW".to_owned(),
            name: "new".to_owned(),
            rate: 1,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            ShardError::Reference { table: "currencies", reason }
                if reason.contains("its source `s0` has no version of the table while the copy on `s1` is at")
        ),
        "{}",
        refused.report()
    );
    // Nor does the instance that wrote before (the source's version it
    // last saw is no licence), the version row gone again.
    exec(&cluster, "s0", "DELETE FROM shardkit_reference_versions").await;
    let refused = currencies
        .insert(currency::Model {
            code: "OLD".to_owned(),
            name: "old".to_owned(),
            rate: 1,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ShardError::Reference { reason, .. } if reason.contains("while the copy on `s1` is at")),
        "{}",
        refused.report()
    );
    assert_eq!(copy_rows("s0").await, 0, "nothing written on the source");
    assert_eq!(copy_rows("s1").await, held, "a copy lost rows");
    drop(no_pass);
}

/// Without a read timeout, a catch-up step still ends within `[rebalance]
/// step_timeout_ms`: a copy whose version row a transaction left open
/// holds is reported behind, not waited on for as long as that transaction
/// lasts (before, `catch_up` and the background pass waited with no bound);
/// once the lock goes, the copy is caught up. `calm` is another instance.
async fn a_catch_up_waiting_on_a_lock_gives_up_after_its_step(dbs: &TestDbs, calm: &Cluster) {
    use sea_orm::TransactionTrait;
    let toml = toml(dbs, 60_000)
        .replace("[read]\ntimeout_ms = 1500\n", "")
        .replace("[rebalance]\n", "[rebalance]\nstep_timeout_ms = 300\n");
    assert!(!toml.contains("timeout_ms = 1500"), "{toml}");
    let bounded = connect(&toml).await;
    let currencies = bounded.reference::<currency::Entity>();
    // No background pass of either instance brings the copy back meanwhile.
    fail::cfg(
        "shardkit::reference::no_pass",
        &format!("return({})", dbs.scope()),
    )
    .unwrap();
    exec(calm, "s1", "DELETE FROM currencies").await;
    exec(
        calm,
        "s1",
        "UPDATE shardkit_reference_versions SET version = 0 WHERE tbl = 'currencies'",
    )
    .await;
    let lock = calm.connection("s1").unwrap().begin().await.unwrap();
    lock.execute_unprepared(
        "UPDATE shardkit_reference_versions SET version = version WHERE tbl = 'currencies'",
    )
    .await
    .unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(30), currencies.catch_up()).await;
    lock.rollback().await.unwrap();
    let status = waited
        .expect("catch_up waited on the lock with no bound")
        .unwrap();
    assert_eq!(status.behind(), ["s1"], "{status:?}");
    // And it says why.
    let why = status.copies[1]
        .catch_up_failed
        .as_deref()
        .unwrap_or_default();
    assert!(
        why.contains("shard `s1`") && why.contains("did not answer within 300ms"),
        "{status:?}"
    );
    assert!(
        status
            .copies
            .iter()
            .all(|c| c.shard == "s1" || c.catch_up_failed.is_none()),
        "{status:?}"
    );
    // The step cut at 300 ms left its statement waiting on the server,
    // which takes the row once the lock goes and holds it until its
    // connection's rollback: a few tries (at most 20 s in all).
    let mut tries = 0;
    let status = loop {
        tries += 1;
        let status = currencies.catch_up().await.unwrap();
        if status.behind().is_empty() || tries == 50 {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    fail::remove("shardkit::reference::no_pass");
    assert!(status.behind().is_empty(), "{status:?}");
}

/// A read timeout of 30 ms bounds reads, not the catch-up of a copy that
/// needs thousands of rows (a shard added, a copy lost): the write of 2,000
/// rows and every copy's catch-up finish, each step bounded by the longer
/// of the read timeout and a mover's step timeout. (Before, each attempt
/// was cut at 30 ms and such a copy never caught up.)
///
/// Then a migration ahead of this build adds a column to the table on
/// every shard: this instance, whose entity lacks it, does not catch a copy
/// up (the copy would hold the column's default where the source holds
/// another value, and count as current), and `verify` says why.
async fn a_copy_that_needs_many_rows_is_caught_up_under_a_short_read_timeout(dbs: &mut TestDbs) {
    let cluster = connect(&toml(dbs, 60_000).replace("timeout_ms = 1500", "timeout_ms = 30")).await;
    cluster.migrate::<Before>().await.unwrap();
    let currencies = cluster.reference::<currency::Entity>();
    let rows = (0..2000).map(|i| currency::Model {
        code: format!("K{i:04}"),
        name: format!("currency k{i}"),
        rate: i,
    });
    let write = currencies
        .insert_many(rows)
        .await
        .unwrap_or_else(|e| panic!("write: {}", e.report()));
    // Every copy lost (as on a shard added to the fleet).
    for shard in ["s1", "s2", "s3", "s4"] {
        exec(&cluster, shard, "DELETE FROM currencies").await;
        exec(&cluster, shard, "DELETE FROM shardkit_reference_versions").await;
    }
    currencies
        .catch_up()
        .await
        .unwrap_or_else(|e| panic!("catch-up: {}", e.report()));
    // Versions read by an instance whose reads are not cut at 30 ms (this
    // machine may be slower than that for a moment).
    let calm = connect(&toml(dbs, 60_000)).await;
    let status = calm.reference::<currency::Entity>().status().await.unwrap();
    assert!(status.behind().is_empty(), "{status:?}");
    assert_eq!(status.source, Some(write.version));
    for shard in ["s1", "s2", "s3", "s4"] {
        let copy = <currency::Entity as sea_orm::EntityTrait>::find()
            .all(cluster.connection(shard).unwrap())
            .await
            .unwrap();
        assert_eq!(copy.len(), 2000, "{shard}");
    }
    a_catch_up_waiting_on_a_lock_gives_up_after_its_step(dbs, &calm).await;
    for shard in ["s0", "s1", "s2", "s3", "s4"] {
        exec(
            &cluster,
            shard,
            "ALTER TABLE currencies ADD COLUMN decimals INTEGER NOT NULL DEFAULT 2",
        )
        .await;
    }
    exec(
        &cluster,
        "s0",
        "UPDATE currencies SET decimals = 0 WHERE code = 'K0001'",
    )
    .await;
    exec(&cluster, "s1", "DELETE FROM currencies").await;
    exec(
        &cluster,
        "s1",
        "UPDATE shardkit_reference_versions SET version = 0 WHERE tbl = 'currencies'",
    )
    .await;
    currencies.catch_up().await.unwrap();
    let status = calm.reference::<currency::Entity>().status().await.unwrap();
    assert_eq!(status.behind(), ["s1"], "{status:?}");
    let refused = currencies.verify(true).await.unwrap_err();
    assert!(
        matches!(&refused, ShardError::Reference { table: "currencies", reason }
            if reason.contains("the source `s0` has column(s) `decimals` that this instance's entity lacks")),
        "{}",
        refused.report()
    );
    let copy = <currency::Entity as sea_orm::EntityTrait>::find()
        .all(cluster.connection("s1").unwrap())
        .await
        .unwrap();
    assert!(copy.is_empty(), "a copy written without the column");
}
