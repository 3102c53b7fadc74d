//! The write pipeline: the one path every [`ShardTx`](crate::ShardTx) write
//! takes, and the stages features attach to it.
//!
//! A write passes, in order:
//!
//! 1. **check**: the row's shard key must be the transaction's
//!    (`ShardTx`'s own, before anything else runs);
//! 2. [`prepare`](WriteStage::prepare): fill what the row lacks (ids);
//! 3. SeaORM's `before_save` / `before_delete`, then the check again, so a
//!    hook cannot move the row;
//! 4. [`replace`](WriteStage::replace): a stage may write the row elsewhere
//!    instead (a rollout in `new_only` writes the new table); the first stage
//!    that does ends the write;
//! 5. the current row, read under the row lock, when a stage
//!    [needs it](WriteStage::needs_current);
//! 6. [`before_write`](WriteStage::before_write): work that must commit
//!    before the row (index rows, index-first);
//! 7. the write itself, with the shard key in its `WHERE` clause;
//! 8. [`after_write`](WriteStage::after_write): work inside the same
//!    transaction (dual writes), and work queued for after the commit
//!    (`WriteCtx::defer`: cache fills, removal of replaced index rows);
//! 9. SeaORM's `after_save` / `after_delete`.
//!
//! An insert, update or delete of an entity that no stage has work for
//! (every stage's [`batch`](WriteStage::batch) answers [`Batch::Statement`])
//! takes steps 1–3, 7 and 9 only: the others would do nothing.
//!
//! Stages are typed by the entity they see (`E`), so they are composed
//! statically: a tuple of stages is a stage that runs its members in order.
//! The cluster's stages are [`crate::cluster::Stages`]; a feature that must see
//! every write (a fence, a change log, a metric) is one implementation of
//! [`WriteStage`] in its own module and one more member of that tuple.
//! Every method has a default that does nothing, so a stage implements
//! only the steps it takes part in, and answers [`batch`](WriteStage::batch)
//! with more than one statement for every entity it has work for in
//! `replace`, `before_write` or `after_write`: that answer decides whether an
//! insert, update or delete takes those steps at all.

use crate::entity::{ShardKey, ShardedEntity};
use crate::error::Result;
use crate::exec::Shards;
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::DatabaseTransaction;
use std::future::Future;
use std::sync::{Mutex, OnceLock};

/// Which write a stage sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOp {
    /// [`ShardTx::insert`](crate::ShardTx::insert).
    Insert,
    /// [`ShardTx::update`](crate::ShardTx::update).
    Update,
    /// [`ShardTx::delete`](crate::ShardTx::delete).
    Delete,
}

impl WriteOp {
    /// `insert`, `update` or `delete`: how errors name the operation.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteOp::Insert => "insert",
            WriteOp::Update => "update",
            WriteOp::Delete => "delete",
        }
    }
}

/// How a batch write may run ([`WriteStage::batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Batch {
    /// One statement with the key's predicate: no stage has work per row.
    Statement,
    /// Row by row through the pipeline: a stage needs each row.
    PerRow,
    /// Refused before any I/O, for this reason.
    Refused(String),
}

impl Batch {
    /// Both stages' answers: a refusal wins, then row by row.
    fn and(self, other: Batch) -> Batch {
        match (self, other) {
            (Batch::Refused(reason), _) | (_, Batch::Refused(reason)) => Batch::Refused(reason),
            (Batch::PerRow, _) | (_, Batch::PerRow) => Batch::PerRow,
            _ => Batch::Statement,
        }
    }
}

/// Work to run once the transaction has committed (never when it rolls
/// back). It must not fail the commit: it logs what it could not do.
pub(crate) type AfterCommit = BoxFuture<'static, ()>;

/// Where a write runs, as its stages see it.
pub struct WriteCtx<'a> {
    pub(crate) shards: &'a Shards,
    pub(crate) txn: &'a DatabaseTransaction,
    pub(crate) shard: ShardId,
    pub(crate) shard_name: &'a str,
    /// The transaction's key.
    pub(crate) key: &'a dyn KeyText,
    /// Its text, made on first use (most writes never need it).
    pub(crate) key_text: &'a OnceLock<String>,
    pub(crate) after_commit: &'a Mutex<Vec<AfterCommit>>,
}

/// A shard key as text ([`ShardKey::to_directory_text`]), whatever its type.
pub(crate) trait KeyText: Send + Sync {
    fn key_text(&self) -> String;
}

impl<K: ShardKey> KeyText for K {
    fn key_text(&self) -> String {
        self.to_directory_text()
    }
}

impl WriteCtx<'_> {
    /// The transaction's key as [`ShardKey::to_directory_text`], as stages
    /// store it.
    pub(crate) fn key(&self) -> &str {
        self.key_text.get_or_init(|| self.key.key_text())
    }

    /// Queues `work` for after the commit, in the order queued.
    pub(crate) fn defer(&self, work: AfterCommit) {
        self.after_commit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(work);
    }
}

/// A stage's write in place of the transaction's own (see
/// [`WriteStage::replace`]).
pub enum Replaced<M> {
    /// An insert or update, written elsewhere: the row as it now reads.
    Saved(M),
    /// A delete: the rows it deleted.
    Deleted(u64),
}

/// What the write did, for [`WriteStage::after_write`].
pub enum Written<'a, E: ShardedEntity> {
    /// An insert or update: the row as stored, and (for an update, when a
    /// stage [asked for it](WriteStage::needs_current)) the row as it was.
    Saved {
        /// The row as stored.
        row: &'a E::Model,
        /// The row before the update.
        current: Option<&'a E::Model>,
    },
    /// A delete of the row `model` names.
    Deleted {
        /// The active model the caller passed (after `before_delete`).
        model: &'a E::ActiveModel,
        /// The row as it was, when a stage asked for it.
        current: Option<&'a E::Model>,
        /// How many rows the `DELETE` removed (0 or 1).
        rows: u64,
    },
}

/// One stage of the write pipeline (see the [module docs](self)).
///
/// An error from [`replace`](Self::replace) or
/// [`after_write`](Self::after_write) makes the transaction rollback-only;
/// one from [`before_write`](Self::before_write) does when the database
/// aborted the transaction.
pub trait WriteStage: sealed::Sealed + Send + Sync + 'static {
    /// Fills what the row lacks, before `before_save` (an insert's id).
    fn prepare<E: ShardedEntity>(
        &self,
        _ctx: &WriteCtx<'_>,
        _op: WriteOp,
        _model: &mut E::ActiveModel,
    ) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Writes the row somewhere else instead of the transaction's own
    /// write; `None` lets the write go on.
    fn replace<E: ShardedEntity>(
        &self,
        _ctx: &WriteCtx<'_>,
        _op: WriteOp,
        _model: &E::ActiveModel,
    ) -> impl Future<Output = Result<Option<Replaced<E::Model>>>> + Send {
        async { Ok(None) }
    }

    /// Whether an update or delete of `E` needs the row as it is now (read
    /// under the row lock before [`before_write`](Self::before_write)).
    fn needs_current<E: ShardedEntity>(&self, _op: WriteOp) -> bool {
        false
    }

    /// How a batch write of `E` ([`ShardTx::update_many`],
    /// [`ShardTx::delete_many`](crate::tx::ShardTx::delete_many)) may run
    /// as far as this stage is concerned: as one statement, row by row
    /// (the batch reads the rows it matches under the row lock and writes
    /// each through the whole pipeline), or not at all.
    ///
    /// Asked of every insert, update and delete too, before anything is
    /// written:
    /// when every stage answers [`Batch::Statement`], the write skips
    /// [`replace`](Self::replace), [`needs_current`](Self::needs_current),
    /// [`before_write`](Self::before_write) and
    /// [`after_write`](Self::after_write). So a stage with work in any of
    /// those for `E` answers `PerRow` (or `Refused`) for `E`.
    ///
    /// [`ShardTx::update_many`]: crate::tx::ShardTx::update_many
    fn batch<E: ShardedEntity>(&self, _ctx: &WriteCtx<'_>, _op: WriteOp) -> Batch {
        Batch::Statement
    }

    /// Work before the write: an insert's or update's index rows.
    /// `current` is the row as it is, when [`needs_current`](Self::needs_current)
    /// asked for it (and it exists).
    fn before_write<E: ShardedEntity>(
        &self,
        _ctx: &WriteCtx<'_>,
        _op: WriteOp,
        _model: &E::ActiveModel,
        _current: Option<&E::Model>,
    ) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Work after the write, in the same transaction (and, through
    /// `WriteCtx::defer`, after its commit).
    fn after_write<E: ShardedEntity>(
        &self,
        _ctx: &WriteCtx<'_>,
        _op: WriteOp,
        _written: Written<'_, E>,
    ) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }
}

/// No stage.
/// Only shardkit's own stages are write stages: a stage runs inside every
/// write's transaction with shardkit's invariants (index first, fences,
/// dual writes), so users compose the ones the cluster registers and
/// cannot add their own. Their types stay nameable (`ShardTx<G, P>`).
pub(crate) mod sealed {
    /// The seal of [`WriteStage`](super::WriteStage).
    pub trait Sealed {}
    impl Sealed for () {}
    impl<A: Sealed, B: Sealed> Sealed for (A, B) {}
}

impl WriteStage for () {}

/// Stages run in order: `A` first, then `B` (for `replace`, the first that
/// replaces the write ends it).
impl<A: WriteStage, B: WriteStage> WriteStage for (A, B) {
    async fn prepare<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &mut E::ActiveModel,
    ) -> Result<()> {
        self.0.prepare::<E>(ctx, op, model).await?;
        self.1.prepare::<E>(ctx, op, model).await
    }

    async fn replace<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
    ) -> Result<Option<Replaced<E::Model>>> {
        match self.0.replace::<E>(ctx, op, model).await? {
            Some(replaced) => Ok(Some(replaced)),
            None => self.1.replace::<E>(ctx, op, model).await,
        }
    }

    fn needs_current<E: ShardedEntity>(&self, op: WriteOp) -> bool {
        self.0.needs_current::<E>(op) || self.1.needs_current::<E>(op)
    }

    fn batch<E: ShardedEntity>(&self, ctx: &WriteCtx<'_>, op: WriteOp) -> Batch {
        // Asked of every write: the common answer takes no `and`.
        match self.0.batch::<E>(ctx, op) {
            Batch::Statement => self.1.batch::<E>(ctx, op),
            first => first.and(self.1.batch::<E>(ctx, op)),
        }
    }

    async fn before_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        model: &E::ActiveModel,
        current: Option<&E::Model>,
    ) -> Result<()> {
        self.0.before_write::<E>(ctx, op, model, current).await?;
        self.1.before_write::<E>(ctx, op, model, current).await
    }

    async fn after_write<E: ShardedEntity>(
        &self,
        ctx: &WriteCtx<'_>,
        op: WriteOp,
        written: Written<'_, E>,
    ) -> Result<()> {
        self.0.after_write::<E>(ctx, op, written.reborrow()).await?;
        self.1.after_write::<E>(ctx, op, written).await
    }
}

impl<'a, E: ShardedEntity> Written<'a, E> {
    fn reborrow(&self) -> Written<'a, E> {
        match *self {
            Written::Saved { row, current } => Written::Saved { row, current },
            Written::Deleted {
                model,
                current,
                rows,
            } => Written::Deleted {
                model,
                current,
                rows,
            },
        }
    }
}
