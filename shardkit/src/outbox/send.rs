//! [`ShardTx::send`]: a message written to the sender's outbox in the
//! sender's transaction.

use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::exec::keyed_tables::OUTBOX;
use crate::outbox::message::{Message, db_err};
use crate::pipeline::WriteStage;
use crate::tx::ShardTx;
use futures::future::BoxFuture;
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Func, Query, SimpleExpr};

/// The longest message name the outbox stores.
const MAX_NAME: usize = 128;

impl<G: EntityGroup, P: WriteStage> ShardTx<G, P> {
    /// Sends `message` to key `to` of group `M::To`: writes it to this
    /// key's outbox in this transaction, so it is sent exactly when the
    /// transaction commits (and never when it rolls back). The relay
    /// ([`Cluster::outbox`](crate::Cluster::outbox)) then applies it once
    /// in a transaction of `to`, by the handler registered for `M`; the
    /// messages this key sends one receiving key are applied in the order
    /// they were sent. Returns the message's id.
    ///
    /// Refused before anything is written when the message does not
    /// serialise or its name is longer than 128 characters
    /// ([`ShardError::CrossKey`]), and like every write when the
    /// transaction is rollback-only or one of its streams is open.
    pub fn send<M>(
        &self,
        to: <M::To as EntityGroup>::Key,
        message: &M,
    ) -> BoxFuture<'_, Result<String>>
    where
        M: Message<From = G>,
    {
        let payload = serde_json::to_string(message);
        Box::pin(async move {
            self.ensure_open()?;
            let id = crate::uuid_v7().to_string();
            let what = || format!("message `{}` {id}", M::NAME);
            if M::NAME.is_empty() || M::NAME.chars().count() > MAX_NAME {
                return Err(ShardError::CrossKey {
                    what: what(),
                    reason: format!("a message name holds 1 to {MAX_NAME} characters"),
                });
            }
            let payload = payload.map_err(|e| ShardError::CrossKey {
                what: what(),
                reason: format!("the message does not serialise: {e}"),
            })?;
            let key = self.key().to_directory_text();
            let now = self.shards().now_ms();
            // The key's next sequence number: the order of a key's messages
            // is in its rows and moves with them. On PostgreSQL and SQLite
            // it is taken in the insert itself (one statement). On
            // MySQL/MariaDB an `INSERT ... SELECT` would take shared
            // next-key locks on the index gap, where two first sends of
            // different keys deadlock: a plain read (no lock) comes first,
            // and sends of one key at once may share a number (ordered by
            // id then). That read sees the transaction's snapshot, taken
            // at its first plain read (REPEATABLE READ), which misses the
            // key's sends committed since: so the number is also past the
            // highest committed, read on a connection of its own (a send
            // after another transaction's committed goes after it).
            let max_seq = SimpleExpr::from(Func::coalesce([
                Expr::col(Alias::new("seq")).max(),
                Expr::val(0i64),
            ]))
            .add(1i64);
            let of_key = |q: &mut sea_orm::sea_query::SelectStatement| {
                q.from(Alias::new(OUTBOX.name))
                    .and_where(Expr::col(Alias::new("grp")).eq(G::NAME))
                    .and_where(Expr::col(Alias::new("key_text")).eq(key.as_str()));
            };
            let mysql =
                self.unchecked_connection().get_database_backend() == sea_orm::DbBackend::MySql;
            let next_seq = if mysql {
                let mut q = Query::select();
                q.expr_as(max_seq, Alias::new("next"));
                of_key(&mut q);
                async fn next<C: ConnectionTrait>(
                    conn: &C,
                    q: &sea_orm::sea_query::SelectStatement,
                ) -> std::result::Result<i64, sea_orm::DbErr> {
                    let row = conn.query_one(q).await?;
                    Ok(row
                        .and_then(|r| r.try_get::<i64>("", "next").ok())
                        .unwrap_or(1))
                }
                let err = |e| self.poison(db_err(self.shard(), OUTBOX.name, "read", e));
                let committed = next(self.shards().side_conn(self.target().shard), &q)
                    .await
                    .map_err(err)?;
                let seen = next(self.unchecked_connection(), &q).await.map_err(err)?;
                Expr::val(Ord::max(seen, committed))
            } else {
                max_seq
            };
            let values: [SimpleExpr; 13] = [
                Expr::val(id.as_str()),
                Expr::val(G::NAME),
                Expr::val(key.as_str()),
                next_seq,
                Expr::val(<M::To as EntityGroup>::NAME),
                Expr::val(to.to_directory_text()),
                Expr::val(M::NAME),
                Expr::val(payload),
                Expr::val("pending"),
                Expr::val(0i32),
                Expr::val(0i64),
                Expr::val(now),
                Expr::val(Option::<String>::None),
            ];
            let mut stmt = Query::insert();
            stmt.into_table(Alias::new(OUTBOX.name))
                .columns(OUTBOX.names());
            if mysql {
                stmt.values_panic(values);
            } else {
                let mut select = Query::select();
                for v in values {
                    select.expr(v);
                }
                of_key(&mut select);
                stmt.select_from(select).map_err(|e| ShardError::Internal {
                    what: format!("the outbox insert does not build: {e}"),
                })?;
            }
            self.unchecked_connection()
                .execute(&stmt)
                .await
                .map_err(|e| self.poison(db_err(self.shard(), OUTBOX.name, "insert into", e)))?;
            Ok(id)
        })
    }
}
