//! The fleet: migrations that fail on one shard and finish on the next run,
//! a migration that lands while a bucket move runs, and reference tables on
//! every shard.

use sea_orm::{ActiveValue::Set, ConnectionTrait};
use sea_orm_migration::prelude::*;
use shardkit::{Cluster, ClusterConfig, JobControl, MigrateOptions, MigrationProgress, ShardError};
use shardkit_tests::{TestDbs, backend_tests};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

backend_tests!(5 =>
    a_failing_migration_leaves_the_others_migrated_and_the_next_run_finishes,
    a_migration_during_a_move_reaches_the_target,
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

const MEMO: &str = "m20261127_000302_notes_memo";

/// Adds `notes.memo`: one statement, so a failure leaves nothing half done
/// on any backend.
struct AddMemo;

impl MigrationName for AddMemo {
    fn name(&self) -> &str {
        MEMO
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddMemo {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("notes"))
                    .add_column(ColumnDef::new(Alias::new("memo")).text().null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("notes"))
                    .drop_column(Alias::new("memo"))
                    .to_owned(),
            )
            .await
    }
}

fn base() -> Vec<Box<dyn MigrationTrait>> {
    use shardkit_tests::models::CreateTable;
    let mut all = shardkit_migration::migrations();
    all.push(Box::new(CreateTable(
        "m20261127_000301_notes",
        note::Entity,
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

#[async_trait::async_trait]
impl MigratorTrait for After {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut all = base();
        all.push(Box::new(AddMemo));
        all
    }
}

const BUCKETS: u32 = 64;

fn toml(dbs: &TestDbs, schema_wait_ms: u64) -> String {
    let shards = dbs
        .shards_toml_with(5, "", &[])
        .replace("max_connections = 4", "max_connections = 2");
    format!(
        "{shards}\n[groups.Writer]\nbuckets = {BUCKETS}\nshards = [\"s0\", \"s1\", \"s2\", \"s3\"]\nmovable = true\n\n[rebalance]\nrefresh_ms = 50\ncleanup_grace_ms = 0\nchunk = 50\nschema_wait_ms = {schema_wait_ms}\n"
    )
}

async fn connect(toml: &str) -> Cluster {
    Cluster::connect(ClusterConfig::from_toml(toml).unwrap())
        .await
        .unwrap()
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
    cluster.migrate::<Before>().await.unwrap();
    let all: Vec<String> = (0..5).map(|i| format!("s{i}")).collect();

    // Cancelled before it starts: nothing runs anywhere.
    let stop = shardkit::CancellationToken::new();
    stop.cancel();
    let report = cluster
        .migrate_with::<After>(MigrateOptions::new().control(JobControl::new().cancel_on(stop)))
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
        shardkit_tests::Backend::Sqlite => "duplicate column name: memo",
        shardkit_tests::Backend::Postgres => "column \"memo\" of relation \"notes\" already exists",
        shardkit_tests::Backend::MySql => "Duplicate column name 'memo'",
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
                let id = 1 + (w * 25 + n) % NOTES;
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
    let plan = old.plan_buckets(back, "s0").await.unwrap();
    let started = old.start(&plan).await.unwrap();
    let err = old.run(started.id).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("has column(s) `memo` that the mover's entity lacks"),
        "{text}"
    );
    old.abort(started.id).await.unwrap();
}
