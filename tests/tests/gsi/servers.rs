//! Index rows commit relaxed (`synchronous_commit = off`) only when their
//! shard and the owner's shard are databases of one PostgreSQL server. The
//! failpoint `shardkit::gsi::server_identity` makes shard `s1` report a server
//! of its own (the test machine has one PostgreSQL server): index rows on `s1`
//! for owners elsewhere, and index rows elsewhere for owners on `s1`, must
//! commit flushed; the rest relaxed.
//!
//! This binary holds only this scenario: the failpoint is process-wide.

use sea_orm::Set;
use shardkit_tests::models::*;
use shardkit_tests::{IndexWrite, TestDbs, backend_tests, index_writes, recording_cluster};

backend_tests!(4 => only_one_server_relaxes);

async fn only_one_server_relaxes(dbs: &mut TestDbs) {
    fail::cfg("shardkit::gsi::server_identity", "return(s1)").unwrap();
    let (cluster, sent) = recording_cluster(dbs, 4, "[groups.Customer]\n").await;
    cluster.migrate::<Migrator>().await.unwrap();
    cluster.gsi().create::<contact::Entity>().await.unwrap();
    let pg =
        cluster.connection("s0").unwrap().get_database_backend() == sea_orm::DbBackend::Postgres;
    let (mut relaxed, mut flushed_across) = (0, 0);
    for i in 0..40_i64 {
        sent.lock().unwrap().clear();
        let tx = cluster.begin::<Customer>(i).await.unwrap();
        tx.insert(contact::ActiveModel {
            id: Set(i),
            customer_id: Set(i),
            email: Set(format!("c{i}@example.com")),
            phone: Set(format!("p{i}")),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let owner = cluster.shard_of::<Customer>(&i).await.unwrap();
        for table in ["gsi_contacts_email", "gsi_contacts_phone"] {
            let writes = index_writes(&sent, table);
            let [
                IndexWrite {
                    shard, relaxed: r, ..
                },
            ] = writes.as_slice()
            else {
                panic!("{table}: one write expected, got {writes:?}");
            };
            if shard == owner {
                assert!(!r);
                continue;
            }
            let one_server = pg && shard != "s1" && owner != "s1";
            assert_eq!(*r, one_server, "{table} on {shard}, owner on {owner}");
            relaxed += usize::from(one_server);
            flushed_across += usize::from(pg && !one_server);
        }
    }
    // Both kinds happened on PostgreSQL, neither elsewhere.
    assert_eq!((relaxed > 0, flushed_across > 0), (pg, pg));
}
