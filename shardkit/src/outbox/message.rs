//! What a message is ([`Message`]), a stored outbox row ([`Row`]), and the
//! typed operations on one message type behind an object the relay calls
//! by the message's name ([`Kind`]).

use crate::cluster::{Cluster, ShardTx};
use crate::entity::{EntityGroup, ShardKey};
use crate::error::{ErrorKind, Origin, Result, ShardError, Subsystem};
use crate::exec::keyed_tables::{INBOX, OUTBOX};
use crate::topology::ShardId;
use futures::FutureExt;
use futures::future::BoxFuture;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{Condition, ConnectionTrait, QueryResult};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// The error a message handler or a saga step returns: any error (a
/// [`ShardError`] converts with `?`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A message one key sends another through the outbox
/// ([`ShardTx::send`](crate::tx::ShardTx::send)), applied exactly once by
/// the handler registered for it ([`Outbox::handle`](crate::Outbox::handle)).
///
/// ```
/// # use shardkit::prelude::*;
/// # #[derive(EntityGroup)] #[shardkit(key = i64)] pub struct Account;
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Credit {
///     amount: i64,
/// }
///
/// impl shardkit::Message for Credit {
///     const NAME: &'static str = "credit";
///     type From = Account;
///     type To = Account;
/// }
/// ```
pub trait Message: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The message's name in the outbox: stable across releases (messages
    /// written by one release are applied by the next), at most 128
    /// characters.
    const NAME: &'static str;
    /// The group whose transactions send it.
    type From: EntityGroup;
    /// The group of the keys it is sent to; its handler runs in a
    /// transaction of the receiving key.
    type To: EntityGroup;
}

/// A row of `shardkit_outbox`.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) id: String,
    pub(crate) grp: String,
    pub(crate) key_text: String,
    pub(crate) seq: i64,
    pub(crate) to_grp: String,
    pub(crate) to_key: String,
    pub(crate) kind: String,
    pub(crate) payload: String,
    pub(crate) state: String,
    pub(crate) attempts: i32,
    pub(crate) next_at: i64,
    pub(crate) created_at: i64,
    pub(crate) last_error: Option<String>,
    /// The shard whose outbox it was read from.
    pub(crate) shard: ShardId,
}

impl Row {
    /// The row `r` of shard `shard`'s outbox.
    pub(crate) fn read(
        r: &QueryResult,
        shard: ShardId,
    ) -> std::result::Result<Row, sea_orm::DbErr> {
        Ok(Row {
            id: r.try_get("", "id")?,
            grp: r.try_get("", "grp")?,
            key_text: r.try_get("", "key_text")?,
            seq: r.try_get("", "seq")?,
            to_grp: r.try_get("", "to_grp")?,
            to_key: r.try_get("", "to_key")?,
            kind: r.try_get("", "kind")?,
            payload: r.try_get("", "payload")?,
            state: r.try_get("", "state")?,
            attempts: r.try_get("", "attempts")?,
            next_at: r.try_get("", "next_at")?,
            created_at: r.try_get("", "created_at")?,
            last_error: r.try_get("", "last_error")?,
            shard,
        })
    }

    /// `message `kind` id` for errors.
    pub(crate) fn what(&self) -> String {
        format!("message `{}` {}", self.kind, self.id)
    }
}

/// What became of one delivery.
#[derive(Debug)]
pub(crate) enum Delivery {
    /// The handler ran and its transaction committed with the inbox row.
    Applied,
    /// The inbox already held the message: applied before.
    Duplicate,
    /// The handler failed (counts as an attempt).
    Failed(String),
    /// The receiving shard could not be reached or failed (not counted as
    /// an attempt: retried after the backoff however long it lasts).
    Unavailable(String),
    /// The message cannot be applied by this release: parked at once.
    Undecodable(String),
    /// The database aborted the transaction (a deadlock): run again.
    Aborted(String),
}

/// A change of a message's row on its sender's shard.
#[derive(Debug)]
pub(crate) enum SourceChange {
    /// Applied: the row is deleted.
    Delivered,
    /// Another attempt after `next_at`; `attempts` counted so far;
    /// `parked` when it will not be tried again.
    Failed {
        error: String,
        attempts: i32,
        next_at: i64,
        parked: bool,
    },
    /// A parked message is pending again, its attempts reset.
    Retry,
    /// A parked message is deleted without being applied.
    Discard,
}

/// The typed operations on one message type, called by name.
pub(crate) trait Kind: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether this instance's map names `shard` the owner of the sender's
    /// key (a copy on another shard, during or after a bucket move, is not
    /// the row to deliver).
    fn owned_by(&self, cluster: &Cluster, row: &Row, shard: &str) -> bool;
    fn has_handler(&self) -> bool;
    fn deliver<'a>(&'a self, cluster: &'a Cluster, row: &'a Row) -> BoxFuture<'a, Delivery>;
    /// Applies `change` to the row in a transaction of the sender's key;
    /// whether the row was there to change.
    fn change<'a>(
        &'a self,
        cluster: &'a Cluster,
        row: &'a Row,
        change: SourceChange,
    ) -> BoxFuture<'a, Result<bool>>;
}

type Handler<M> = Arc<
    dyn Fn(
            Arc<ShardTx<<M as Message>::To>>,
            M,
        ) -> BoxFuture<'static, std::result::Result<(), BoxError>>
        + Send
        + Sync,
>;

/// Message type `M`'s operations; `handler` when this instance applies it.
pub(crate) struct Typed<M: Message> {
    pub(crate) handler: Option<Handler<M>>,
}

pub(crate) fn db_err(shard: &str, table: &str, what: &str, e: sea_orm::DbErr) -> ShardError {
    ShardError::db(
        Origin::table(Subsystem::CrossKey, table),
        shard.to_owned(),
        format!("{what} {table}"),
        e,
    )
}

/// Whether an error means the database could not do the work now (a shard
/// down, a lost connection, a timeout, a moved bucket, a deadlock), not
/// that the work itself failed: such a delivery is retried without
/// counting an attempt. SeaORM's own `DbErr` (a statement the work sent
/// itself, through `unchecked_connection` or to a database of its own)
/// counts only when the database aborted the transaction (a deadlock, a
/// serialization failure): its other errors, a connection's included, may
/// be the work's for good (a statement over the protocol's bind limit, a
/// database the work names that is gone), and are counted, so the message
/// is parked after its attempts rather than put off for ever.
pub(crate) fn not_the_work(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(shard) = e.downcast_ref::<ShardError>() {
            return match shard.kind() {
                ErrorKind::Routing => true,
                ErrorKind::Database => !matches!(shard.retry(), crate::Retry::Never),
                _ => false,
            };
        }
        if let Some(db) = e.downcast_ref::<sea_orm::DbErr>() {
            return crate::error::db_retry(db) == crate::Retry::Transaction;
        }
        cause = e.source();
    }
    false
}

/// Whether this instance's map names `shard` the owner of `key_text` (a
/// copy a bucket move left or made elsewhere is not the row to act on). A
/// key the map cannot place without I/O (a directory-placed group, whose
/// keys never move) is the shard's that holds the row; so is one that does
/// not parse (acting on it parks it with the reason).
pub(crate) fn owned_by<G: EntityGroup>(cluster: &Cluster, key_text: &str, shard: &str) -> bool {
    match <G::Key as ShardKey>::from_directory_text(key_text).map(|k| cluster.shard_of_now::<G>(&k))
    {
        Some(Ok(Some(owner))) => owner == shard,
        _ => true,
    }
}

/// Records message `id` in the receiving key's inbox, in its transaction:
/// `false` when it is there already (applied before, or by a relay that
/// raced this one and committed first).
pub(crate) async fn record_in_inbox<G: EntityGroup>(
    tx: &ShardTx<G>,
    id: &str,
    now_ms: i64,
) -> Result<bool> {
    let key = tx.key().to_directory_text();
    let stmt = Query::insert()
        .into_table(Alias::new(INBOX.name))
        .columns(INBOX.names())
        .values_panic([id.into(), G::NAME.into(), key.into(), now_ms.into()])
        .to_owned();
    match tx.unchecked_connection().execute(&stmt).await {
        Ok(_) => Ok(true),
        Err(e) if crate::error::is_unique_violation(&e) => Ok(false),
        Err(e) => Err(db_err(tx.shard(), INBOX.name, "insert into", e)),
    }
}

/// Whether the receiving key's inbox holds `id`, read in its transaction.
pub(crate) async fn in_inbox<G: EntityGroup>(tx: &ShardTx<G>, id: &str) -> Result<bool> {
    tx.unchecked_connection()
        .query_one(&inbox_row(id))
        .await
        .map(|r| r.is_some())
        .map_err(|e| db_err(tx.shard(), INBOX.name, "read", e))
}

/// Why a handler's or a saga step's transaction runs again, when the
/// database ended it (a deadlock, a serialization failure met by one of its
/// statements) whatever the work made of that error: one that handled the
/// error itself, then returned `Ok` or another error (the `RollbackOnly`
/// refusal of its next statement), failed only because of a transient
/// conflict, not of its own.
pub(crate) fn ended_by_the_database<G: EntityGroup>(tx: &ShardTx<G>) -> Option<String> {
    tx.was_aborted().then(|| {
        format!(
            "the database ended the transaction; it runs again: {}",
            tx.poison_reason().unwrap_or_default()
        )
    })
}

/// Why a handler's or a saga step's `Ok` on a rollback-only transaction
/// committed nothing.
pub(crate) fn rollback_only(reason: &str) -> String {
    format!(
        "it returned Ok on a transaction an earlier refusal made rollback-only (an error it did \
         not return); nothing was committed: {reason}"
    )
}

/// The read of message `id`'s row in the inbox.
fn inbox_row(id: &str) -> sea_orm::sea_query::SelectStatement {
    Query::select()
        .column(Alias::new("id"))
        .from(Alias::new(INBOX.name))
        .and_where(Expr::col(Alias::new("id")).eq(id))
        .to_owned()
}

/// A delivery whose work failed (`why`, counted), its transaction `tx`
/// rolled back. On PostgreSQL (`inbox_last`: the inbox row goes in after
/// the handler) a message applied before, whose sender's row was not
/// deleted then, may be refused by a handler that sees its own work
/// ("already credited"): when the inbox holds it, read outside any
/// transaction, it is a duplicate (a failed read counts the failure).
async fn failed_unless_applied<G: EntityGroup>(
    cluster: &Cluster,
    tx: ShardTx<G>,
    inbox_last: bool,
    id: &str,
    why: String,
) -> Delivery {
    let shard = tx.shard().to_owned();
    let _ = tx.rollback().await;
    if !inbox_last {
        return Delivery::Failed(why);
    }
    let Some(conn) = cluster.connection(&shard) else {
        return Delivery::Failed(why);
    };
    let within = cluster
        .shards()
        .read_settings()
        .control_bound()
        .max(std::time::Duration::from_secs(1));
    match tokio::time::timeout(within, conn.query_one(&inbox_row(id))).await {
        Ok(Ok(Some(_))) => Delivery::Duplicate,
        _ => Delivery::Failed(why),
    }
}

/// Whether `err` says a key has no shard at all (as opposed to a shard that
/// could not be reached): waiting does not help until the directory or the
/// config changes.
fn unplaceable(err: &ShardError) -> bool {
    matches!(
        err,
        ShardError::Unroutable { .. } | ShardError::UnknownGroup { .. }
    )
}

impl<M: Message> Typed<M> {
    async fn apply(&self, cluster: &Cluster, row: &Row) -> Delivery {
        let Some(to) = <<M::To as EntityGroup>::Key as ShardKey>::from_directory_text(&row.to_key)
        else {
            return Delivery::Undecodable(format!(
                "the receiving key {:?} is not a key of group {}",
                row.to_key,
                <M::To as EntityGroup>::NAME
            ));
        };
        let message: M = match serde_json::from_str(&row.payload) {
            Ok(m) => m,
            Err(e) => {
                return Delivery::Undecodable(format!(
                    "the payload does not decode as `{}`: {e}",
                    std::any::type_name::<M>()
                ));
            }
        };
        let Some(handler) = &self.handler else {
            return Delivery::Unavailable("no handler in this relay".to_owned());
        };
        let tx = match cluster.begin::<M::To>(to).await {
            Ok(tx) => tx,
            Err(e) if e.retry() == crate::Retry::Transaction => {
                return Delivery::Aborted(e.report().to_string());
            }
            // No shard holds the receiving key (no directory entry, outside
            // every range): counted like a handler's failure, so the message
            // is parked after its attempts instead of put off for ever.
            Err(e) if unplaceable(&e) => return Delivery::Failed(e.report().to_string()),
            Err(e) => return Delivery::Unavailable(e.report().to_string()),
        };
        // PostgreSQL: the inbox row goes in last (below), where its insert
        // also proves the transaction is still alive. Elsewhere first, so
        // a message applied before is found before the handler runs.
        let inbox_last =
            tx.unchecked_connection().get_database_backend() == sea_orm::DbBackend::Postgres;
        if !inbox_last {
            match record_in_inbox(&tx, &row.id, cluster.shards().now_ms()).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = tx.rollback().await;
                    return Delivery::Duplicate;
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Delivery::Unavailable(e.report().to_string());
                }
            }
        }
        let tx = Arc::new(tx);
        // A handler that panics fails its attempt like one that returns an
        // error: the panic would otherwise end the relay's task for this
        // shard, and the message would panic it again after a restart,
        // never counted or parked. (Its transaction was dropped with it.)
        let handled = Arc::clone(&tx);
        let outcome = std::panic::AssertUnwindSafe(async move { handler(handled, message).await })
            .catch_unwind()
            .await;
        let Ok(tx) = Arc::try_unwrap(tx) else {
            return Delivery::Failed(
                "the handler kept a clone of its ShardTx past its end; nothing was committed"
                    .to_owned(),
            );
        };
        // A handler that handled the database's abort of its transaction
        // itself: run again after a short pause, not counted (as a
        // propagated abort; see `deliver`).
        if outcome.is_ok()
            && let Some(why) = ended_by_the_database(&tx)
        {
            let _ = tx.rollback().await;
            return Delivery::Aborted(why);
        }
        let failed = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) if not_the_work(e.as_ref()) => {
                let _ = tx.rollback().await;
                return Delivery::Unavailable(e.to_string());
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(panic) => Some(format!(
                "the handler panicked: {}",
                panic_text(panic.as_ref())
            )),
        };
        if let Some(failed) = failed {
            return failed_unless_applied(cluster, tx, inbox_last, &row.id, failed).await;
        }
        // A handler that swallowed a refusal of shardkit's (a unique
        // index value taken, a write off its key) returns `Ok` on a
        // transaction that can only roll back: its commit would fail the
        // same way at every delivery, so it is the work's failure, counted.
        // As after a handler's error, the refusal may be its own earlier
        // work's (a message applied before).
        if let Some(reason) = tx.poison_reason() {
            let why = rollback_only(&reason);
            return failed_unless_applied(cluster, tx, inbox_last, &row.id, why).await;
        }
        // A handler that swallowed a failed statement returns `Ok` on a
        // transaction the database already ended (PostgreSQL then answers
        // COMMIT with a rollback, not an error): the inbox row read back
        // in the transaction proves the commit carries the work.
        // The read's own error is the cause (PostgreSQL: "current
        // transaction is aborted"); a lost connection puts the message off.
        // On PostgreSQL the inbox insert does both: a transaction the
        // database ended refuses it ("current transaction is aborted"), and
        // a message applied before (or by a relay that raced this one)
        // conflicts with its row, so this attempt's work is rolled back.
        // (MySQL/MariaDB need the read-back: after a deadlock a handler
        // swallowed, the statements that follow commit on their own, so an
        // insert there would succeed without the work.)
        let ended = if inbox_last {
            match record_in_inbox(&tx, &row.id, cluster.shards().now_ms()).await {
                Ok(true) => None,
                Ok(false) => {
                    let _ = tx.rollback().await;
                    return Delivery::Duplicate;
                }
                Err(e) if not_the_work(&e) => {
                    let _ = tx.rollback().await;
                    return Delivery::Unavailable(e.report().to_string());
                }
                Err(e) => Some(e.report().to_string()),
            }
        } else {
            match in_inbox(&tx, &row.id).await {
                Ok(true) => None,
                Ok(false) => Some(String::from("its inbox row is gone")),
                Err(e) if not_the_work(&e) => {
                    let _ = tx.rollback().await;
                    return Delivery::Unavailable(e.report().to_string());
                }
                Err(e) => Some(e.report().to_string()),
            }
        };
        if let Some(cause) = ended {
            let _ = tx.rollback().await;
            return Delivery::Failed(format!(
                "the handler returned Ok on a transaction the database had ended (a failed \
                 statement whose error it did not return); nothing was committed: {cause}"
            ));
        }
        match tx.commit().await {
            Ok(()) => Delivery::Applied,
            Err(e) if e.retry() == crate::Retry::Transaction => {
                Delivery::Aborted(e.report().to_string())
            }
            Err(e) => Delivery::Unavailable(e.report().to_string()),
        }
    }
}

impl<M: Message> Kind for Typed<M> {
    fn name(&self) -> &'static str {
        M::NAME
    }

    fn owned_by(&self, cluster: &Cluster, row: &Row, shard: &str) -> bool {
        owned_by::<M::From>(cluster, &row.key_text, shard)
    }

    fn has_handler(&self) -> bool {
        self.handler.is_some()
    }

    fn deliver<'a>(&'a self, cluster: &'a Cluster, row: &'a Row) -> BoxFuture<'a, Delivery> {
        Box::pin(async move {
            // A transaction the database aborted (a deadlock with another
            // writer of the key) runs again after a short pause, twice at
            // most.
            let mut attempt = 0;
            loop {
                attempt += 1;
                match self.apply(cluster, row).await {
                    Delivery::Aborted(_) if attempt < 3 => {
                        tokio::time::sleep(crate::error::abort_backoff(attempt)).await;
                    }
                    Delivery::Aborted(e) => return Delivery::Unavailable(e),
                    other => return other,
                }
            }
        })
    }

    fn change<'a>(
        &'a self,
        cluster: &'a Cluster,
        row: &'a Row,
        change: SourceChange,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let key =
                <<M::From as EntityGroup>::Key as ShardKey>::from_directory_text(&row.key_text);
            let statement = change_statement(row, &change);
            let shards = cluster.shards();
            let group = <M::From as EntityGroup>::NAME;
            // A group whose buckets never move has no fence to read: the
            // change is one statement on the key's shard. A movable group's
            // runs in a transaction of the key, behind its fence. A key
            // this release cannot read has no bucket a move could take:
            // the change is one statement on the shard it was read from.
            let Some(key) = key else {
                return change_on(cluster, group, row.shard, &statement).await;
            };
            if !shards.topology().is_movable(group) {
                let target = shards.route::<M::From>(&key).await?;
                return change_on(cluster, group, target.shard, &statement).await;
            }
            let statement = &statement;
            cluster
                .transaction::<M::From, _, _>(key, |tx| async move {
                    let conn = tx.unchecked_connection();
                    let n = conn
                        .execute_raw(statement(conn.get_database_backend()))
                        .await
                        .map_err(|e| db_err(tx.shard(), OUTBOX.name, "write", e))?
                        .rows_affected();
                    Ok(n > 0)
                })
                .await
        })
    }
}

/// Runs `statement` (a change to an outbox row of `group`) on shard
/// `shard` on its own, under the shard's breaker; whether it changed a row.
async fn change_on(
    cluster: &Cluster,
    group: &'static str,
    shard: ShardId,
    statement: &impl Fn(sea_orm::DbBackend) -> sea_orm::Statement,
) -> Result<bool> {
    let shards = cluster.shards();
    let conn = shards.shard_conn(shard);
    let name = shards.shard_name(shard);
    let run = async {
        conn.execute_raw(statement(conn.get_database_backend()))
            .await
            .map_err(|e| db_err(name, OUTBOX.name, "write", e))
    };
    let n = shards
        .bounded(shard, group, None, run)
        .await?
        .rows_affected();
    Ok(n > 0)
}

/// The statement that makes `change` to `row` in its sender's outbox.
fn change_statement(
    row: &Row,
    change: &SourceChange,
) -> impl Fn(sea_orm::DbBackend) -> sea_orm::Statement {
    let table = Alias::new(OUTBOX.name);
    let this = Condition::all()
        .add(Expr::col(Alias::new("id")).eq(row.id.as_str()))
        .add(Expr::col(Alias::new("grp")).eq(row.grp.as_str()))
        .add(Expr::col(Alias::new("key_text")).eq(row.key_text.as_str()));
    let parked = Expr::col(Alias::new("state")).eq("parked");
    enum Built {
        Delete(sea_orm::sea_query::DeleteStatement),
        Update(sea_orm::sea_query::UpdateStatement),
    }
    let built = match change {
        SourceChange::Delivered => Built::Delete(
            Query::delete()
                .from_table(table)
                .cond_where(this)
                .to_owned(),
        ),
        SourceChange::Discard => Built::Delete(
            Query::delete()
                .from_table(table)
                .cond_where(this.add(parked))
                .to_owned(),
        ),
        SourceChange::Failed {
            error,
            attempts,
            next_at,
            parked,
        } => Built::Update(
            Query::update()
                .table(table)
                .value(Alias::new("attempts"), *attempts)
                .value(Alias::new("next_at"), *next_at)
                .value(Alias::new("last_error"), stored_error(error).as_ref())
                .value(
                    Alias::new("state"),
                    if *parked { "parked" } else { "pending" },
                )
                // Not a message parked (or retried) meanwhile.
                .cond_where(this.add(Expr::col(Alias::new("state")).eq("pending")))
                .to_owned(),
        ),
        SourceChange::Retry => Built::Update(
            Query::update()
                .table(table)
                .value(Alias::new("attempts"), 0)
                .value(Alias::new("next_at"), 0i64)
                .value(Alias::new("state"), "pending")
                .cond_where(this.add(parked))
                .to_owned(),
        ),
    };
    move |backend| match &built {
        Built::Delete(q) => backend.build(q),
        Built::Update(q) => backend.build(q),
    }
}

/// What a panic said (`panic!`'s message), or that it said nothing readable.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// The most of an error's text a row keeps (a message's `last_error`, a
/// saga's `error`). MySQL/MariaDB's `TEXT` holds 65,535 bytes: a longer
/// text would fail the update that records the failure, and the message
/// would be neither put off nor parked, its handler run again at every
/// pass.
const STORED_ERROR_BYTES: usize = 8 * 1024;

/// `text` as a row keeps it: cut at [`STORED_ERROR_BYTES`] (on a character
/// boundary), saying how much was cut.
pub(crate) fn stored_error(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= STORED_ERROR_BYTES {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut end = STORED_ERROR_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!(
        "{}… ({} more bytes cut)",
        &text[..end],
        text.len() - end
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_error_is_cut_on_a_character_boundary() {
        assert_eq!(stored_error("short"), "short");
        let long = format!("a{}", "é".repeat(STORED_ERROR_BYTES));
        let kept = stored_error(&long);
        assert!(kept.len() <= STORED_ERROR_BYTES + 40, "{}", kept.len());
        assert!(kept.starts_with("aé"));
        let cut = long.len() - kept.find('…').unwrap();
        assert!(
            kept.ends_with(&format!("… ({cut} more bytes cut)")),
            "{kept}"
        );
    }
}
