//! TPC-B, pgbench's transaction, through plain SeaORM and through shardkit,
//! sharded by branch: update an account, read it back, update its teller and
//! its branch, insert a history row; the balances of accounts, tellers,
//! branches and history must agree after every run.
//!
//! Variants: `plain` (SeaORM on one database, B), `one` (shardkit on one
//! shard, D), `four` (shardkit on four shards, C), and, for throughput,
//! `plainfour` (B4: plain SeaORM on four databases of the same server, each
//! branch on the database where `four` placed it, a pool per database as
//! `four` has: what four databases of one server give without shardkit), on
//! PostgreSQL and MySQL/MariaDB (`SHARDKIT_PG_URL`, `SHARDKIT_MYSQL_URL`; a server that does
//! not answer is skipped).
//!
//! - `cargo bench -p shardkit-tests --bench tpcb`: transactions per second
//!   at 8 and 32 clients, the variants interleaved round by round, medians
//!   (each backend and client count in a process of its own). The variants
//!   share out the same connections (four databases: a quarter each);
//!   `TPCB_FOUR_POOL=n` gives each of the four databases a pool of `n`.
//!   `TPCB_BRANCHES=n` loads `n` branches instead of 8.
//! - `tests/benches/tpcb.sh`: client instructions per transaction under
//!   callgrind (`tpcb <plain|keyed|one|four|plainfour> <postgres|mysql> <transactions>`,
//!   one task on a current-thread runtime). `keyed` is plain SeaORM sending
//!   the statements shardkit sends: each also matches the branch (`AND bid
//!   = $n`), the predicate shardkit adds to every statement of a key's
//!   transaction; against it, `one` shows shardkit's own work.

use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, Database, DatabaseConnection, EntityTrait,
    ExprTrait, QueryFilter, TransactionTrait,
};
use shardkit::{Cluster, ClusterConfig};
use shardkit_tests::{Backend, interleaved};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

const BRANCHES: i64 = 8;

/// Branches: `TPCB_BRANCHES`, else [`BRANCHES`] (pgbench's scale). Few
/// branches hash unevenly over four shards (8 land 0, 4, 1 and 3 with 64
/// buckets); the program prints where they landed.
fn branches() -> i64 {
    static N: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("TPCB_BRANCHES")
            .map(|v| v.parse().unwrap())
            .unwrap_or(BRANCHES)
    })
}
const TELLERS: i64 = 10; // per branch
const ACCOUNTS: i64 = 1_000; // per branch
const ROUNDS: usize = 5;
const PER_CLIENT: i64 = 200;

#[derive(shardkit::EntityGroup)]
#[shardkit(key = i64)]
pub struct Branch;

pub mod branch {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "tpcb_branches")]
    #[shardkit(group = super::Branch)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        #[shardkit(shard_key)]
        pub bid: i64,
        pub bbalance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod teller {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "tpcb_tellers")]
    #[shardkit(group = super::Branch)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub tid: i64,
        #[shardkit(shard_key)]
        pub bid: i64,
        pub tbalance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod account {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "tpcb_accounts")]
    #[shardkit(group = super::Branch)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub aid: i64,
        #[shardkit(shard_key)]
        pub bid: i64,
        pub abalance: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod history {
    use sea_orm::entity::prelude::*;

    #[sea_orm::model]
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, shardkit::Sharded)]
    #[sea_orm(table_name = "tpcb_history")]
    #[shardkit(group = super::Branch)]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub hid: i64,
        pub tid: i64,
        #[shardkit(shard_key)]
        pub bid: i64,
        pub aid: i64,
        pub delta: i64,
        pub mtime: i64,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

pub struct Migrator;

#[sea_orm_migration::async_trait::async_trait]
impl sea_orm_migration::MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn sea_orm_migration::MigrationTrait>> {
        use shardkit_tests::models::CreateTable;
        let mut all = shardkit_migration::migrations();
        all.push(Box::new(CreateTable(
            "m20261127_000501_tpcb_branches",
            branch::Entity,
        )));
        all.push(Box::new(CreateTable(
            "m20261127_000502_tpcb_tellers",
            teller::Entity,
        )));
        all.push(Box::new(CreateTable(
            "m20261127_000503_tpcb_accounts",
            account::Entity,
        )));
        all.push(Box::new(CreateTable(
            "m20261127_000504_tpcb_history",
            history::Entity,
        )));
        all
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Plain,
    /// Plain SeaORM with shardkit's key predicate (callgrind only).
    Keyed,
    One,
    Four,
    /// Plain SeaORM on four databases (for throughput; callgrind's mode
    /// takes it too).
    PlainFour,
}

impl Variant {
    /// The variants measured for throughput.
    const ALL: [Variant; 4] = [
        Variant::Plain,
        Variant::One,
        Variant::Four,
        Variant::PlainFour,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Keyed => "keyed",
            Variant::One => "one",
            Variant::Four => "four",
            Variant::PlainFour => "plainfour",
        }
    }

    fn databases(self) -> usize {
        match self {
            Variant::Four | Variant::PlainFour => 4,
            _ => 1,
        }
    }
}

/// What a transaction is about: pgbench's random account, teller, branch
/// and delta (the account's branch: every transaction stays on one key).
#[derive(Clone, Copy)]
struct Txn {
    aid: i64,
    tid: i64,
    bid: i64,
    delta: i64,
}

fn txn(seed: &mut u64) -> Txn {
    let mut next = |m: i64| {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*seed >> 33) % m as u64) as i64
    };
    let bid = next(branches()) + 1;
    Txn {
        bid,
        aid: (bid - 1) * ACCOUNTS + next(ACCOUNTS) + 1,
        tid: (bid - 1) * TELLERS + next(TELLERS) + 1,
        delta: next(10_001) - 5_000,
    }
}

static HISTORY_ID: AtomicI64 = AtomicI64::new(1);

fn history_row(t: Txn) -> history::ActiveModel {
    history::ActiveModel {
        hid: Set(HISTORY_ID.fetch_add(1, Ordering::Relaxed)),
        tid: Set(t.tid),
        bid: Set(t.bid),
        aid: Set(t.aid),
        delta: Set(t.delta),
        mtime: Set(0),
    }
}

/// One TPC-B transaction with plain SeaORM; `keyed`: every statement also
/// matches the branch, as shardkit's do.
async fn plain(db: &DatabaseConnection, t: Txn, keyed: bool) -> i64 {
    let txn = db.begin().await.expect("begin");
    let mut update = account::Entity::update_many()
        .col_expr(
            account::Column::Abalance,
            Expr::col(account::Column::Abalance).add(t.delta),
        )
        .filter(account::Column::Aid.eq(t.aid));
    if keyed {
        update = update.filter(account::Column::Bid.eq(t.bid));
    }
    update.exec(&txn).await.expect("account");
    let mut find = account::Entity::find().filter(account::Column::Aid.eq(t.aid));
    if keyed {
        find = find.filter(account::Column::Bid.eq(t.bid));
    }
    let balance = find
        .one(&txn)
        .await
        .expect("read")
        .expect("the account")
        .abalance;
    let mut update = teller::Entity::update_many()
        .col_expr(
            teller::Column::Tbalance,
            Expr::col(teller::Column::Tbalance).add(t.delta),
        )
        .filter(teller::Column::Tid.eq(t.tid));
    if keyed {
        update = update.filter(teller::Column::Bid.eq(t.bid));
    }
    update.exec(&txn).await.expect("teller");
    branch::Entity::update_many()
        .col_expr(
            branch::Column::Bbalance,
            Expr::col(branch::Column::Bbalance).add(t.delta),
        )
        .filter(branch::Column::Bid.eq(t.bid))
        .exec(&txn)
        .await
        .expect("branch");
    history::Entity::insert(history_row(t))
        .exec_without_returning(&txn)
        .await
        .expect("history");
    txn.commit().await.expect("commit");
    balance
}

/// The same transaction through shardkit, in the branch's key.
async fn sharded(cluster: &Cluster, t: Txn) -> i64 {
    cluster
        .transaction::<Branch, _, _>(t.bid, |tx| async move {
            tx.update_many::<account::Entity>()
                .col_expr(
                    account::Column::Abalance,
                    Expr::col(account::Column::Abalance).add(t.delta),
                )
                .filter(account::Column::Aid.eq(t.aid))
                .exec()
                .await?;
            let balance = tx
                .find::<account::Entity>()
                .filter(account::Column::Aid.eq(t.aid))
                .one()
                .await?
                .expect("the account")
                .abalance;
            tx.update_many::<teller::Entity>()
                .col_expr(
                    teller::Column::Tbalance,
                    Expr::col(teller::Column::Tbalance).add(t.delta),
                )
                .filter(teller::Column::Tid.eq(t.tid))
                .exec()
                .await?;
            tx.update_many::<branch::Entity>()
                .col_expr(
                    branch::Column::Bbalance,
                    Expr::col(branch::Column::Bbalance).add(t.delta),
                )
                .exec()
                .await?;
            tx.insert_without_returning(history_row(t)).await?;
            Ok(balance)
        })
        .await
        .expect("a TPC-B transaction")
}

/// A variant's databases, created afresh and loaded.
struct Setup {
    variant: Variant,
    /// Plain SeaORM's pools, one per database, and the index of each
    /// branch's (`bid - 1`).
    plain: Vec<DatabaseConnection>,
    db_of: Vec<usize>,
    cluster: Option<Cluster>,
}

impl Setup {
    async fn run(&self, t: Txn) -> i64 {
        match &self.cluster {
            None => {
                let db = &self.plain[self.db_of[t.bid as usize - 1]];
                plain(db, t, self.variant == Variant::Keyed).await
            }
            Some(cluster) => sharded(cluster, t).await,
        }
    }

    fn connections(&self) -> Vec<DatabaseConnection> {
        match &self.cluster {
            None => self.plain.clone(),
            Some(cluster) => (0..self.variant.databases())
                .map(|i| cluster.connection(&format!("s{i}")).unwrap().clone())
                .collect(),
        }
    }

    /// The sums of account, teller and branch balances and of history
    /// deltas: equal after any number of committed transactions.
    async fn check_balances(&self) {
        let mut sums = [0i64; 4];
        for db in self.connections() {
            for (i, sql) in [
                "SELECT CAST(COALESCE(SUM(abalance), 0) AS SIGNED) AS s FROM tpcb_accounts",
                "SELECT CAST(COALESCE(SUM(tbalance), 0) AS SIGNED) AS s FROM tpcb_tellers",
                "SELECT CAST(COALESCE(SUM(bbalance), 0) AS SIGNED) AS s FROM tpcb_branches",
                "SELECT CAST(COALESCE(SUM(delta), 0) AS SIGNED) AS s FROM tpcb_history",
            ]
            .iter()
            .enumerate()
            {
                let sql = if db.get_database_backend() == sea_orm::DbBackend::Postgres {
                    sql.replace("SIGNED", "BIGINT")
                } else {
                    (*sql).to_owned()
                };
                let row = db
                    .query_one_raw(sea_orm::Statement::from_string(
                        db.get_database_backend(),
                        sql,
                    ))
                    .await
                    .unwrap()
                    .unwrap();
                sums[i] += row.try_get::<i64>("", "s").unwrap();
            }
        }
        assert!(
            sums.iter().all(|s| *s == sums[0]),
            "{}: balances disagree (accounts, tellers, branches, history): {sums:?}",
            self.variant.name()
        );
    }
}

fn server(backend: Backend) -> String {
    backend.server_url().expect("a server backend")
}

async fn setup(backend: Backend, variant: Variant, pool: u32) -> Option<Setup> {
    let server = server(backend);
    let admin = Database::connect(&server).await.ok()?;
    let names: Vec<String> = (0..variant.databases())
        .map(|i| format!("skt_tpcb_{}_{i}", variant.name()))
        .collect();
    for name in &names {
        let drop = match backend {
            Backend::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            _ => format!("DROP DATABASE IF EXISTS {name}"),
        };
        admin.execute_unprepared(&drop).await.unwrap();
        admin
            .execute_unprepared(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
    }
    let mut toml = format!("[pool]\nmax_connections = {pool}\nacquire_timeout_secs = 60\n");
    for (i, name) in names.iter().enumerate() {
        toml.push_str(&format!(
            "[[shards]]\nname = \"s{i}\"\nurl = \"{server}/{name}\"\n"
        ));
    }
    toml.push_str("[groups.Branch]\nbuckets = 64\n");
    let cluster = Cluster::connect(ClusterConfig::from_toml(&toml).unwrap())
        .await
        .unwrap();
    cluster.migrate::<Migrator>().await.unwrap();
    // Load: every branch with its tellers and accounts, one transaction per
    // branch.
    for bid in 1..=branches() {
        cluster
            .transaction::<Branch, _, _>(bid, |tx| async move {
                tx.insert_without_returning(branch::ActiveModel {
                    bid: Set(bid),
                    bbalance: Set(0),
                })
                .await?;
                for t in 1..=TELLERS {
                    tx.insert_without_returning(teller::ActiveModel {
                        tid: Set((bid - 1) * TELLERS + t),
                        bid: Set(bid),
                        tbalance: Set(0),
                    })
                    .await?;
                }
                for a in 1..=ACCOUNTS {
                    tx.insert_without_returning(account::ActiveModel {
                        aid: Set((bid - 1) * ACCOUNTS + a),
                        bid: Set(bid),
                        abalance: Set(0),
                    })
                    .await?;
                }
                Ok(())
            })
            .await
            .unwrap();
    }
    Some(match variant {
        Variant::Plain | Variant::Keyed | Variant::PlainFour => {
            // Each branch on the database shardkit placed it on: the same
            // as `four`'s, since placement is a function of the key and of
            // the shards, which both configs name alike.
            let mut db_of = Vec::new();
            for bid in 1..=branches() {
                let shard = cluster.shard_of::<Branch>(&bid).await.unwrap();
                let i = (0..names.len()).position(|i| shard == format!("s{i}"));
                db_of.push(i.expect("a shard of the config"));
            }
            if variant == Variant::PlainFour {
                let mut per = vec![0; names.len()];
                for d in &db_of {
                    per[*d] += 1;
                }
                eprintln!("tpcb: branches per database of the four: {per:?}");
            }
            drop(cluster);
            let mut plain = Vec::new();
            for name in &names {
                let mut options = sea_orm::ConnectOptions::new(format!("{server}/{name}"));
                options.max_connections(pool).sqlx_logging(false);
                plain.push(Database::connect(options).await.unwrap());
            }
            Setup {
                variant,
                plain,
                db_of,
                cluster: None,
            }
        }
        _ => Setup {
            variant,
            plain: Vec::new(),
            db_of: Vec::new(),
            cluster: Some(cluster),
        },
    })
}

/// Transactions per second at `clients` clients, each variant's median of
/// interleaved rounds.
async fn throughput(backend: Backend, clients: i64) -> Option<[f64; 4]> {
    let mut setups = Vec::new();
    for v in Variant::ALL {
        // The same connections in all in every variant: as many as
        // clients, at most 24, so at 32 clients some wait for a connection
        // in every variant alike. The four variants' pools (96) and
        // shardkit's side pools, opened as needed, fit in PostgreSQL's
        // default of 100 connections only because the side pools stay
        // mostly closed here. `TPCB_FOUR_POOL=n` gives each of the four
        // databases a pool of `n` instead (as a deployment sizes a pool
        // per database): above 6 at 32 clients, raise the server's limit.
        let pool = match std::env::var("TPCB_FOUR_POOL") {
            Ok(n) if v.databases() == 4 => n.parse().expect("TPCB_FOUR_POOL: a number"),
            _ => std::cmp::min(clients, 24) / v.databases() as i64,
        };
        setups.push(Arc::new(setup(backend, v, pool as u32).await?));
    }
    let job = |kind: usize| {
        let setup = Arc::clone(&setups[kind]);
        Box::pin(async move {
            let tasks: Vec<_> = (0..clients)
                .map(|c| {
                    let setup = Arc::clone(&setup);
                    tokio::spawn(async move {
                        let mut seed = (c as u64 + 1) * 0x9E37_79B9;
                        for _ in 0..PER_CLIENT {
                            setup.run(txn(&mut seed)).await;
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        }) as shardkit_tests::Job<'static>
    };
    let medians = interleaved(ROUNDS, Variant::ALL.len(), job).await;
    for s in &setups {
        s.check_balances().await;
    }
    let n = (clients * PER_CLIENT) as f64;
    Some(std::array::from_fn(|i| n / medians[i].as_secs_f64()))
}

/// `n` transactions from one task, for callgrind.
async fn count(backend: Backend, variant: Variant, n: i64) {
    let setup = setup(backend, variant, 2).await.expect("the server");
    let mut seed = 7;
    for _ in 0..n {
        setup.run(txn(&mut seed)).await;
    }
    setup.check_balances().await;
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let backend_of = |name: &str| match name {
        "postgres" => Backend::Postgres,
        "mysql" => Backend::MySql,
        other => panic!("backend `{other}`: expected postgres or mysql"),
    };
    match args.as_slice() {
        [mode, backend, clients] if mode == "throughput" => {
            let backend = backend_of(backend);
            let clients: i64 = clients.parse().expect("a number of clients");
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            match runtime.block_on(throughput(backend, clients)) {
                Some([b, d, c, b4]) => println!(
                    "tpcb/{backend:?}/{clients} clients: plain {b:.0} tps, shardkit one shard {d:.0} tps ({:.2}x), four shards {c:.0} tps ({:.2}x of one shard); plain on four databases {b4:.0} tps ({:.2}x of plain on one)",
                    d / b,
                    c / d,
                    b4 / b
                ),
                None => println!("tpcb/{backend:?}: no server: skipped"),
            }
        }
        [variant, backend, n] => {
            let variant = [Variant::Keyed]
                .into_iter()
                .chain(Variant::ALL)
                .find(|v| v.name() == variant)
                .unwrap_or_else(|| {
                    panic!("variant `{variant}`: expected plain, keyed, one, four or plainfour")
                });
            let n: i64 = n.parse().expect("a number of transactions");
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(count(backend_of(backend), variant, n));
        }
        // Each backend and client count in a process of its own, so that
        // one run's connections are closed before the next opens its own.
        [] => {
            let exe = std::env::current_exe().expect("this program");
            for backend in ["postgres", "mysql"] {
                for clients in ["8", "32"] {
                    let status = std::process::Command::new(&exe)
                        .args(["throughput", backend, clients])
                        .status()
                        .expect("a run");
                    assert!(status.success(), "tpcb {backend} {clients}: {status}");
                }
            }
        }
        _ => {
            panic!("usage: tpcb [<plain|keyed|one|four|plainfour> <postgres|mysql> <transactions>]")
        }
    }
}
