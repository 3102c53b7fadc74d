//! [`Cluster::transaction_once`]: a transaction run at most once per
//! request id, its outcome stored with the id on the key's shard.

use crate::cluster::{Cluster, ShardTx};
use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError, again_after_abort};
use crate::exec::keyed_tables::REQUESTS;
use crate::outbox::message::db_err;
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::sync::Arc;

pub use crate::exec::keyed_tables::REQUEST_TTL;

/// Runs of the work when the database ended its transaction.
const ATTEMPTS: u32 = 3;

/// The longest request id stored.
const MAX_REQUEST_ID: usize = 200;

/// The longest outcome stored, in bytes of JSON (MySQL/MariaDB's `TEXT`).
const MAX_OUTCOME: usize = 65_535;

/// The row id of request `request_id` of `key_text` in group `group`: the
/// key's length first, so no two (key, request) pairs share one.
pub(crate) fn request_row_id(group: &str, key_text: &str, request_id: &str) -> String {
    format!("{group}|{}|{key_text}|{request_id}", key_text.len())
}

impl Cluster {
    /// Runs `work` in a transaction of `key` at most once per
    /// `request_id`: its outcome (`T`, serialised with serde) is stored
    /// with the id on the key's shard in the same transaction, so a retry
    /// of the request (a client that timed out and sent it again, many
    /// at once) gets the stored outcome without running `work` again.
    ///
    /// A retry that arrives while the first run's transaction is open waits
    /// for it (the id's row is locked) and then returns its outcome. When
    /// `work` fails, nothing is stored and a retry runs it again; like
    /// [`transaction`](Self::transaction), a transaction the database
    /// aborted runs again (3 attempts in all, after the same short pause).
    /// Outcomes are kept for [`REQUEST_TTL`]. A request id holds 1 to 200
    /// characters and is scoped to the key (another key's request of the
    /// same id is another request); an empty or longer one, or an outcome
    /// that does not serialise, is refused with [`ShardError::CrossKey`].
    pub async fn transaction_once<G, T, Fut>(
        &self,
        key: G::Key,
        request_id: &str,
        mut work: impl FnMut(Arc<ShardTx<G>>) -> Fut,
    ) -> Result<T>
    where
        G: EntityGroup,
        T: Serialize + DeserializeOwned,
        Fut: Future<Output = Result<T>>,
    {
        let what = || format!("request {request_id:?} of {} key {key:?}", G::NAME);
        if request_id.is_empty() || request_id.chars().count() > MAX_REQUEST_ID {
            return Err(ShardError::CrossKey {
                what: what(),
                reason: format!("a request id holds 1 to {MAX_REQUEST_ID} characters"),
            });
        }
        // MySQL/MariaDB compare `'pay-1'` and `'pay-1 '` as one id.
        if request_id.ends_with(' ') {
            return Err(ShardError::CrossKey {
                what: what(),
                reason: "a request id does not end with a space (MySQL and MariaDB would take it \
                         for the id without its trailing spaces)"
                    .to_owned(),
            });
        }
        let key_text = key.to_directory_text();
        let id = request_row_id(G::NAME, &key_text, request_id);
        // Transactions the database aborted (3 attempts in all), and rounds
        // lost to another run of the same request (its claim, or a new one
        // where an expired row was), counted apart.
        let mut attempt = 0u32;
        let mut races = 0;
        let raced = || ShardError::CrossKey {
            what: what(),
            reason: "other runs of the same request kept taking its row first; nothing was \
                     committed, try again"
                .to_owned(),
        };
        // Another run took the request's row first: read it again.
        macro_rules! lost_race {
            ($tx:expr) => {{
                let _ = $tx.rollback().await;
                races += 1;
                if races >= 5 {
                    return Err(raced());
                }
                attempt -= 1;
                continue;
            }};
        }
        loop {
            attempt += 1;
            let tx = self.begin::<G>(key.clone()).await?;
            let shard = tx.shard().to_owned();
            let err = |op: &str| {
                let shard = shard.clone();
                let op = op.to_owned();
                move |e| db_err(&shard, REQUESTS.name, &op, e)
            };
            let now = self.shards().now_ms();
            let stored = Query::select()
                .columns([Alias::new("outcome"), Alias::new("created_at")])
                .from(Alias::new(REQUESTS.name))
                .and_where(Expr::col(Alias::new("id")).eq(id.as_str()))
                .to_owned();
            let row = tx
                .unchecked_connection()
                .query_one(&stored)
                .await
                .map_err(err("read"))?;
            if let Some(row) = row {
                let outcome: Option<String> = row.try_get("", "outcome").map_err(err("read"))?;
                let created: i64 = row.try_get("", "created_at").map_err(err("read"))?;
                match outcome {
                    Some(text) if now - created < REQUEST_TTL.as_millis() as i64 => {
                        let _ = tx.rollback().await;
                        return serde_json::from_str(&text).map_err(|e| ShardError::CrossKey {
                            what: what(),
                            reason: format!(
                                "its stored outcome does not decode as `{}`: {e}",
                                std::any::type_name::<T>()
                            ),
                        });
                    }
                    // Expired (or left without an outcome by a release
                    // that stored none): forgotten. Only the row read: on
                    // MySQL/MariaDB the read is a snapshot and the delete
                    // acts on the row as it is now, which may be another
                    // run's new claim (then read again).
                    _ => {
                        let gone = Query::delete()
                            .from_table(Alias::new(REQUESTS.name))
                            .and_where(Expr::col(Alias::new("id")).eq(id.as_str()))
                            .and_where(Expr::col(Alias::new("created_at")).eq(created))
                            .to_owned();
                        let deleted = tx
                            .unchecked_connection()
                            .execute(&gone)
                            .await
                            .map_err(err("delete from"))?
                            .rows_affected();
                        if deleted == 0 {
                            lost_race!(tx);
                        }
                    }
                }
            }
            // The claim: a concurrent run of the same id waits here for
            // this transaction, then finds the id taken.
            let claim = Query::insert()
                .into_table(Alias::new(REQUESTS.name))
                .columns(REQUESTS.names())
                .values_panic([
                    id.as_str().into(),
                    G::NAME.into(),
                    key_text.as_str().into(),
                    request_id.into(),
                    Option::<String>::None.into(),
                    now.into(),
                ])
                .to_owned();
            match tx.unchecked_connection().execute(&claim).await {
                Ok(_) => {}
                // Another run committed the id first: read its outcome.
                Err(e) if crate::error::is_unique_violation(&e) => lost_race!(tx),
                Err(e) => {
                    let e = err("insert into")(e);
                    let _ = tx.rollback().await;
                    if again_after_abort(&e, false, attempt, ATTEMPTS).await {
                        continue;
                    }
                    return Err(e);
                }
            }
            let tx = Arc::new(tx);
            let outcome = work(Arc::clone(&tx)).await;
            // The database ended this run: whatever the work returned (it may
            // have handled the abort's error itself), a new run can succeed.
            let aborted = tx.was_aborted();
            let Ok(tx) = Arc::try_unwrap(tx) else {
                return Err(ShardError::RollbackOnly {
                    group: G::NAME,
                    shard,
                    reason: "the transaction closure kept a clone of its ShardTx past its end; \
                             nothing was committed"
                        .to_owned(),
                });
            };
            let value = match outcome {
                Ok(value) => value,
                Err(e) => {
                    let _ = tx.rollback().await;
                    if again_after_abort(&e, aborted, attempt, ATTEMPTS).await {
                        continue;
                    }
                    return Err(e);
                }
            };
            // `Ok` on a transaction left rollback-only (a refusal or an
            // abort the work did not return): nothing to store or commit,
            // and on MySQL/MariaDB the store would run outside it.
            if let Some(reason) = tx.poison_reason() {
                let _ = tx.rollback().await;
                let err = ShardError::RollbackOnly {
                    group: G::NAME,
                    shard,
                    reason,
                };
                if again_after_abort(&err, aborted, attempt, ATTEMPTS).await {
                    continue;
                }
                return Err(err);
            }
            let refuse = |reason: String| ShardError::CrossKey {
                what: what(),
                reason,
            };
            let text = match serde_json::to_string(&value) {
                Ok(text) if text.len() <= MAX_OUTCOME => text,
                Ok(text) => {
                    let _ = tx.rollback().await;
                    return Err(refuse(format!(
                        "its outcome is {} bytes of JSON, and one holds at most {MAX_OUTCOME} (a \
                         MySQL/MariaDB TEXT column): store the result in a row of the work's own \
                         and return its id; nothing was committed",
                        text.len()
                    )));
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(refuse(format!("the outcome does not serialise: {e}")));
                }
            };
            // Only this run's claim: on MySQL/MariaDB a transaction the
            // database ended (a deadlock the work swallowed) runs what
            // follows on its own, and the claim it rolled back may be
            // another run's by now, with that run's outcome.
            let store = Query::update()
                .table(Alias::new(REQUESTS.name))
                .value(Alias::new("outcome"), text)
                .and_where(Expr::col(Alias::new("id")).eq(id.as_str()))
                .and_where(Expr::col(Alias::new("outcome")).is_null())
                .to_owned();
            // One row, or the work swallowed a failed statement and the
            // database ended the transaction: nothing to commit.
            let ended = "the work returned Ok on a transaction the database had ended (a failed \
                         statement whose error it did not return); nothing was committed";
            let stored = match tx.unchecked_connection().execute(&store).await {
                Ok(done) => done.rows_affected(),
                // PostgreSQL refuses every statement after a failed one
                // (SQLSTATE 25P02, "current transaction is aborted").
                Err(e) if crate::error::database_code(&e).as_deref() == Some("25P02") => {
                    let _ = tx.rollback().await;
                    return Err(refuse(format!(
                        "{ended}: {}",
                        crate::error::DriverCause(&e)
                    )));
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(err("update")(e));
                }
            };
            if stored != 1 {
                let _ = tx.rollback().await;
                return Err(refuse(ended.to_owned()));
            }
            match tx.commit().await {
                Ok(()) => return Ok(value),
                Err(e) if again_after_abort(&e, false, attempt, ATTEMPTS).await => {}
                Err(e) => return Err(e),
            }
        }
    }
}
