//! shardkit's own CPU cost next to plain SeaORM, counted in instructions.
//!
//! Wall-clock ratios drift ±20% on a small VM; instruction counts under
//! `valgrind --tool=callgrind` repeat. One invocation runs one variant:
//!
//! ```text
//! overhead <plain|shardkit|session> <sqlite|postgres> <read|update|delete> <operations>
//! ```
//!
//! - `read`: a keyed point read of one row (`cluster.find().key(k)` + primary
//!   key) against SeaORM's `Entity::find()` with the same two predicates on
//!   the same database.
//! - `session` (reads only): the keyed read with
//!   `Consistency::AtLeast(session)`, a session holding a position for the
//!   shard (which has no replica, so the shard answers): the client-side
//!   cost of the session's bookkeeping, compared with `shardkit`.
//! - `update`: a one-row update transaction (`cluster.begin(k)`,
//!   `tx.update`, `commit`) against SeaORM's `begin_with_options`,
//!   `Entity::update` with the same key predicate, `commit`. Both begin the
//!   same way: `BEGIN IMMEDIATE` on SQLite (shardkit takes a write
//!   transaction's lock up front, see `exec::begin`), `BEGIN` elsewhere.
//! - `delete`: a one-row delete transaction by primary key (`tx.delete`)
//!   against SeaORM's `Entity::delete` with the same key predicate, begun
//!   and committed as `update`'s. The first deletes the row; the others
//!   send the same statement and match nothing, on both sides alike.
//!
//! Set-up (connecting, migrating, the row) is the same whatever the count,
//! so the difference between two counts divided by the difference in
//! operations is the marginal cost of one operation. `tests/benches/overhead.sh`
//! runs every variant at two counts under callgrind and prints the ratios.
//! Run without arguments (as `cargo bench` does) it runs each variant briefly
//! on SQLite, to keep the code working.

use sea_orm::ActiveValue::{Set, Unchanged};
use sea_orm::{
    ColumnTrait, DatabaseConnection, EntityTrait, QueryFilter, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
};
use shardkit::{Cluster, Consistency, Session};
use shardkit_tests::models::{Customer, Migrator, order};
use shardkit_tests::{Backend, TestDbs};

const KEY: i64 = 42;
const ROW: i64 = 1;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    Shardkit,
    Session,
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Read,
    Update,
    Delete,
}

async fn read(mode: Mode, cluster: &Cluster, db: &DatabaseConnection, session: &Session) {
    let row = match mode {
        Mode::Plain => order::Entity::find()
            .filter(order::Column::CustomerId.eq(KEY))
            .filter(order::Column::Id.eq(ROW))
            .one(db)
            .await
            .expect("plain read"),
        Mode::Shardkit => cluster
            .find::<order::Entity>()
            .key(KEY)
            .filter(order::Column::Id.eq(ROW))
            .one()
            .await
            .expect("keyed read"),
        Mode::Session => cluster
            .find::<order::Entity>()
            .key(KEY)
            .filter(order::Column::Id.eq(ROW))
            .consistency(Consistency::at_least(session))
            .one()
            .await
            .expect("keyed read with a session"),
    };
    std::hint::black_box(row.expect("the row exists"));
}

/// Plain SeaORM's write transaction, begun as shardkit begins one.
async fn begin_plain(db: &DatabaseConnection) -> sea_orm::DatabaseTransaction {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
    .expect("begin")
}

async fn update(mode: Mode, cluster: &Cluster, db: &DatabaseConnection, value: i64) {
    let model = order::ActiveModel {
        id: Unchanged(ROW),
        customer_id: Unchanged(KEY),
        total_cents: Set(value),
    };
    match mode {
        Mode::Plain => {
            let txn = begin_plain(db).await;
            let row = order::Entity::update(model)
                .validate()
                .expect("a valid update")
                .filter(order::Column::CustomerId.eq(KEY))
                .exec(&txn)
                .await
                .expect("plain update");
            txn.commit().await.expect("commit");
            std::hint::black_box(row);
        }
        Mode::Shardkit | Mode::Session => {
            let tx = cluster.begin::<Customer>(KEY).await.expect("begin");
            let row = tx.update(model).await.expect("update");
            tx.commit().await.expect("commit");
            std::hint::black_box(row);
        }
    }
}

async fn delete(mode: Mode, cluster: &Cluster, db: &DatabaseConnection) {
    let model = order::ActiveModel {
        id: Unchanged(ROW),
        customer_id: Unchanged(KEY),
        total_cents: sea_orm::ActiveValue::NotSet,
    };
    let rows = match mode {
        Mode::Plain => {
            let txn = begin_plain(db).await;
            let rows = order::Entity::delete(model)
                .validate()
                .expect("a valid delete")
                .filter(order::Column::CustomerId.eq(KEY))
                .exec(&txn)
                .await
                .expect("plain delete")
                .rows_affected;
            txn.commit().await.expect("commit");
            rows
        }
        Mode::Shardkit | Mode::Session => {
            let tx = cluster.begin::<Customer>(KEY).await.expect("begin");
            let rows = tx.delete(model).await.expect("delete");
            tx.commit().await.expect("commit");
            rows
        }
    };
    std::hint::black_box(rows);
}

async fn run(mode: Mode, backend: Backend, op: Op, operations: i64) {
    let dbs = TestDbs::create(backend, "bench::overhead", 1).await;
    let cluster = dbs.cluster(1, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.expect("migrate");
    let db = cluster.connection("s0").expect("shard s0").clone();
    order::Entity::insert(order::ActiveModel {
        id: Set(ROW),
        customer_id: Set(KEY),
        total_cents: Set(0),
    })
    .exec(&db)
    .await
    .expect("the row");
    // A session holding the shard's position after a commit.
    let session = Session::new();
    let tx = cluster.begin::<Customer>(KEY).await.expect("begin");
    tx.commit_in(&session).await.expect("commit");
    for i in 0..operations {
        match op {
            Op::Read => read(mode, &cluster, &db, &session).await,
            Op::Update => update(mode, &cluster, &db, i).await,
            Op::Delete => delete(mode, &cluster, &db).await,
        }
    }
    drop(db);
    drop(cluster);
    dbs.cleanup().await;
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let parsed = match args.as_slice() {
        [mode, backend, op, n] => {
            let mode = match mode.as_str() {
                "plain" => Mode::Plain,
                "shardkit" => Mode::Shardkit,
                "session" => Mode::Session,
                other => panic!("mode `{other}`: expected plain, shardkit or session"),
            };
            let backend = match backend.as_str() {
                "sqlite" => Backend::Sqlite,
                "postgres" => Backend::Postgres,
                other => panic!("backend `{other}`: expected sqlite or postgres"),
            };
            let op = match op.as_str() {
                "read" => Op::Read,
                "update" => Op::Update,
                "delete" => Op::Delete,
                other => panic!("operation `{other}`: expected read, update or delete"),
            };
            let n: i64 = n
                .parse()
                .unwrap_or_else(|_| panic!("operations `{n}`: not a number"));
            Some((mode, backend, op, n))
        }
        [] => None,
        _ => {
            panic!(
                "usage: overhead <plain|shardkit|session> <sqlite|postgres> <read|update|delete> <operations>"
            )
        }
    };
    runtime.block_on(async {
        match parsed {
            Some((mode, backend, op, n)) => run(mode, backend, op, n).await,
            None => {
                for mode in [Mode::Plain, Mode::Shardkit, Mode::Session] {
                    for op in [Op::Read, Op::Update, Op::Delete] {
                        run(mode, Backend::Sqlite, op, 20).await;
                    }
                }
                println!(
                    "overhead: smoke run done; tests/benches/overhead.sh prints instruction ratios"
                );
            }
        }
    });
}
