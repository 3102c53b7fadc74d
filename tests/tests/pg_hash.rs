//! shardkit's bucket agrees with PostgreSQL's own hash partitioning: for
//! 10,000 keys of each type, `satisfies_hash_partition(parent, 1024, bucket,
//! key)` holds for the bucket shardkit routed the key to, and for no other.

use sea_orm::{ConnectionTrait, DatabaseConnection};
use shardkit::Cluster;
use shardkit_tests::models::{Account, Customer, Device, Tenant};
use shardkit_tests::{TestDbs, backend_tests};

backend_tests!(1 => [Postgres] buckets_match_postgres_hash_partitioning);

const KEYS: usize = 10_000;
const BUCKETS: u32 = 1024;

/// Counts keys whose PostgreSQL partition disagrees with shardkit's bucket
/// (`shift = 0`), or that would satisfy a wrong bucket (`shift = 1`).
async fn disagreements(
    db: &DatabaseConnection,
    table: &str,
    sql_type: &str,
    rows: &[(String, u32)],
    shift: u32,
) -> i64 {
    let mut values = String::with_capacity(rows.len() * 48);
    for (i, (literal, bucket)) in rows.iter().enumerate() {
        if i > 0 {
            values.push(',');
        }
        values.push_str(&format!(
            "({literal}::{sql_type}, {})",
            (bucket + shift) % BUCKETS
        ));
    }
    let condition = if shift == 0 { "NOT " } else { "" };
    let sql = format!(
        "SELECT count(*) AS n FROM (VALUES {values}) AS t(k, b) \
         WHERE {condition}satisfies_hash_partition('{table}'::regclass, {BUCKETS}, b, k)"
    );
    let row = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            sql,
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get::<i64>("", "n").unwrap()
}

async fn check(db: &DatabaseConnection, table: &str, sql_type: &str, rows: Vec<(String, u32)>) {
    assert_eq!(rows.len(), KEYS);
    db.execute_unprepared(&format!(
        "CREATE TABLE {table} (k {sql_type}) PARTITION BY HASH (k)"
    ))
    .await
    .unwrap();
    assert_eq!(
        disagreements(db, table, sql_type, &rows, 0).await,
        0,
        "{sql_type}: buckets disagree with PostgreSQL"
    );
    assert_eq!(
        disagreements(db, table, sql_type, &rows, 1).await,
        0,
        "{sql_type}: the check accepts wrong buckets"
    );
}

async fn bucket<G: shardkit::EntityGroup>(cluster: &Cluster, key: &G::Key) -> u32 {
    cluster
        .route::<G>(key)
        .await
        .unwrap()
        .bucket
        .expect("hash placement")
}

async fn buckets_match_postgres_hash_partitioning(dbs: &mut TestDbs) {
    let groups = "[groups.Customer]\nbuckets = 1024\n[groups.Tenant]\nbuckets = 1024\n[groups.Device]\nbuckets = 1024\n[groups.Account]\nbuckets = 1024\n";
    let cluster = dbs.cluster(1, groups).await;
    let db = cluster.connection("s0").unwrap();

    // bigint: spread over the whole range, negatives and extremes included.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut ints: Vec<i64> = vec![
        0,
        1,
        -1,
        i64::MIN,
        i64::MAX,
        i64::from(i32::MAX) + 1,
        -(1 << 32),
    ];
    while ints.len() < KEYS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = x as i64 >> (x % 60);
        ints.push(v);
    }
    let mut rows = Vec::with_capacity(KEYS);
    for k in &ints {
        rows.push((format!("'{k}'"), bucket::<Customer>(&cluster, k).await));
    }
    check(db, "hp_bigint", "bigint", rows).await;

    // integer (i32 keys).
    let mut rows = Vec::with_capacity(KEYS);
    for k in ints.iter().map(|v| *v as i32) {
        rows.push((format!("'{k}'"), bucket::<Account>(&cluster, &k).await));
    }
    check(db, "hp_integer", "integer", rows).await;

    // text: lengths 0..60, ASCII and multibyte.
    let mut rows = Vec::with_capacity(KEYS);
    for (i, v) in ints.iter().enumerate() {
        let mut s = format!("tenant-{v:x}");
        if i % 3 == 0 {
            s.push_str("-żółw-日本");
        }
        s.truncate(
            s.char_indices()
                .map(|(p, _)| p)
                .nth(i % 40)
                .unwrap_or(s.len()),
        );
        rows.push((
            format!("'{}'", s.replace('\'', "''")),
            bucket::<Tenant>(&cluster, &s).await,
        ));
    }
    check(db, "hp_text", "text", rows).await;

    // uuid.
    let mut rows = Vec::with_capacity(KEYS);
    for v in &ints {
        let u = uuid::Uuid::from_u64_pair(*v as u64, v.rotate_left(17) as u64 ^ 0x5bd1_e995);
        rows.push((format!("'{u}'"), bucket::<Device>(&cluster, &u).await));
    }
    check(db, "hp_uuid", "uuid", rows).await;

    drop(cluster);
}
