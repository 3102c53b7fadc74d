//! Sagas: a sequence of steps, each a transaction on one key with a
//! compensation, whose state lives on the originating key's shard.
//!
//! Each step's transaction records `saga:<id>:<i>:run` in its key's inbox,
//! and each compensation `saga:<id>:<i>:undo`, so a step (or compensation)
//! committed by a process that died before it saved the saga's progress is
//! not applied again when the saga resumes. A compensation of a step that
//! never committed records the step's `run` marker itself and undoes
//! nothing, so a late run of that step (a process still running it) finds
//! the marker and applies nothing.

use crate::cluster::{Cluster, ShardTx};
use crate::entity::{EntityGroup, ShardKey};
use crate::error::{Result, ShardError};
use crate::exec::keyed_tables::SAGAS;
use crate::outbox::message::{
    BoxError, db_err, ended_by_the_database, in_inbox, not_the_work, owned_by, panic_text,
    record_in_inbox, rollback_only,
};
use crate::topology::ShardId;
use futures::future::BoxFuture;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, QueryResult};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// Where a saga is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SagaState {
    /// Running its steps; `step` is the next to run.
    Running,
    /// A step was refused: undoing the steps before it, last first; `step`
    /// counts the steps still to undo.
    Compensating,
    /// Every step committed.
    Done,
    /// Every step that committed was undone.
    Compensated,
}

impl SagaState {
    fn as_str(self) -> &'static str {
        match self {
            SagaState::Running => "running",
            SagaState::Compensating => "compensating",
            SagaState::Done => "done",
            SagaState::Compensated => "compensated",
        }
    }

    fn parse(s: &str) -> Option<SagaState> {
        Some(match s {
            "running" => SagaState::Running,
            "compensating" => SagaState::Compensating,
            "done" => SagaState::Done,
            "compensated" => SagaState::Compensated,
            _ => return None,
        })
    }

    /// Whether nothing more will happen to it.
    pub fn is_finished(self) -> bool {
        matches!(self, SagaState::Done | SagaState::Compensated)
    }
}

/// A saga as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SagaStatus {
    /// Its id.
    pub id: String,
    /// The saga's name ([`Saga::new`]).
    pub name: String,
    /// The originating group and key (directory text).
    pub origin: (String, String),
    /// Where it is.
    pub state: SagaState,
    /// The next step to run (running), or the steps still to undo
    /// (compensating).
    pub step: i32,
    /// Failed attempts at the current step.
    pub attempts: i32,
    /// Why it is compensating, or the last failed attempt's error.
    pub error: Option<String>,
    /// When it was started and last changed (ms since the Unix epoch).
    pub created_at: i64,
    /// When it last changed.
    pub updated_at: i64,
}

impl SagaStatus {
    fn read(r: &QueryResult) -> std::result::Result<(SagaStatus, String, i64), sea_orm::DbErr> {
        let state: String = r.try_get("", "state")?;
        let id: String = r.try_get("", "id")?;
        // Not taken for another: a saga driven as `running` whose row says
        // otherwise would have every save refused, and be driven forever.
        let Some(state) = SagaState::parse(&state) else {
            return Err(sea_orm::DbErr::Type(format!(
                "saga {id}: its state `{state}` is not one this release knows \
                 (running, compensating, done, compensated)"
            )));
        };
        Ok((
            SagaStatus {
                id,
                name: r.try_get("", "name")?,
                origin: (r.try_get("", "grp")?, r.try_get("", "key_text")?),
                state,
                step: r.try_get("", "step")?,
                attempts: r.try_get("", "attempts")?,
                error: r.try_get("", "error")?,
                created_at: r.try_get("", "created_at")?,
                updated_at: r.try_get("", "updated_at")?,
            },
            r.try_get("", "data")?,
            r.try_get("", "next_at")?,
        ))
    }
}

/// What a [`Sagas::resume`] pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SagaReport {
    /// Sagas that ran every step.
    pub done: u64,
    /// Sagas whose compensations all ran.
    pub compensated: u64,
    /// Sagas driven and left unfinished for now (a shard unreachable, a
    /// step or a compensation to try again after its backoff). Sagas still
    /// waiting out an earlier backoff are neither driven nor counted.
    pub waiting: u64,
    /// Shards whose sagas could not be read: theirs are driven at a later
    /// resume, and the other shards' now.
    pub unreachable: u64,
}

/// How one step (or compensation) went.
enum Outcome {
    /// Committed now, or before (its inbox marker was there).
    Done,
    /// The step's work returned an error of its own: the saga compensates.
    Refused(String),
    /// A shard could not be reached: try again later.
    Later(String),
}

type Work<G, D> = Arc<
    dyn Fn(Arc<ShardTx<G>>, D) -> BoxFuture<'static, std::result::Result<(), BoxError>>
        + Send
        + Sync,
>;

/// One step, its group erased.
trait Step<D>: Send + Sync {
    fn run<'a>(
        &'a self,
        cluster: &'a Cluster,
        saga: &'a str,
        i: usize,
        data: &'a D,
        undo: bool,
    ) -> BoxFuture<'a, Outcome>;
}

/// Which key of group `G` a step runs on, from the saga's data.
type KeyOf<G, D> = Arc<dyn Fn(&D) -> <G as EntityGroup>::Key + Send + Sync>;

struct TypedStep<G: EntityGroup, D> {
    key: KeyOf<G, D>,
    run: Work<G, D>,
    undo: Work<G, D>,
}

impl<G: EntityGroup, D: Clone + Send + Sync + 'static> Step<D> for TypedStep<G, D> {
    fn run<'a>(
        &'a self,
        cluster: &'a Cluster,
        saga: &'a str,
        i: usize,
        data: &'a D,
        undo: bool,
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            // A key that no shard holds here waits too, not refused: another
            // instance (a config rolled out there first, a directory entry
            // assigned meanwhile) may place it and run the step, whose undo
            // could then never be fenced.
            // A step that panics (its key, its work or its compensation) is
            // refused like one that returns an error: the panic would
            // otherwise end `drive` and every `resume`, at this saga, for
            // good. (Its transaction, dropped with it, rolls back.)
            let step = std::panic::AssertUnwindSafe(self.attempt(cluster, saga, i, data, undo));
            match futures::FutureExt::catch_unwind(step).await {
                Ok(outcome) => outcome,
                Err(panic) => {
                    Outcome::Refused(format!("the step panicked: {}", panic_text(panic.as_ref())))
                }
            }
        })
    }
}

impl<G: EntityGroup, D: Clone + Send + Sync + 'static> TypedStep<G, D> {
    /// [`Step::run`], a panic not caught.
    async fn attempt(
        &self,
        cluster: &Cluster,
        saga: &str,
        i: usize,
        data: &D,
        undo: bool,
    ) -> Outcome {
        let tx = match cluster.begin::<G>((self.key)(data)).await {
            Ok(tx) => tx,
            Err(e) => return Outcome::Later(e.report().to_string()),
        };
        let now = cluster.shards().now_ms();
        let marker = |what: &str| format!("saga:{saga}:{i}:{what}");
        let marked = |id: String| {
            let tx = &tx;
            async move { record_in_inbox(tx, &id, now).await }
        };
        // Undo: once; and only a step that ran (a step that never
        // committed gets its run marker now, so it never will). A
        // marker found taken ends the transaction (PostgreSQL aborts it
        // at the refused insert): read before the second insert.
        let found = if undo {
            match marked(marker("undo")).await {
                Ok(true) => match in_inbox(&tx, &marker("run")).await {
                    Ok(true) => Ok(Some(&self.undo)),
                    Ok(false) => match marked(marker("run")).await {
                        Ok(true) => Ok(None),
                        Ok(false) => Err(Outcome::Later(
                            "a run of the step committed meanwhile".to_owned(),
                        )),
                        Err(e) => Err(Outcome::Later(e.report().to_string())),
                    },
                    Err(e) => Err(Outcome::Later(e.report().to_string())),
                },
                Ok(false) => Err(Outcome::Done),
                Err(e) => Err(Outcome::Later(e.report().to_string())),
            }
        } else {
            match marked(marker("run")).await {
                Ok(true) => Ok(Some(&self.run)),
                Ok(false) => Err(Outcome::Done),
                Err(e) => Err(Outcome::Later(e.report().to_string())),
            }
        };
        let work = match found {
            Ok(work) => work,
            Err(outcome) => {
                let _ = tx.rollback().await;
                return outcome;
            }
        };
        let tx = Arc::new(tx);
        if let Some(work) = work
            && let Err(e) = work(Arc::clone(&tx), data.clone()).await
        {
            let ended = ended_by_the_database(&tx);
            if let Ok(tx) = Arc::try_unwrap(tx) {
                let _ = tx.rollback().await;
            }
            // The database ended the transaction (a deadlock), whatever
            // error the work made of it: tried again, not compensated.
            if let Some(why) = ended {
                return Outcome::Later(why);
            }
            return if not_the_work(e.as_ref()) {
                Outcome::Later(e.to_string())
            } else {
                Outcome::Refused(e.to_string())
            };
        }
        let Ok(tx) = Arc::try_unwrap(tx) else {
            return Outcome::Refused(
                "the step kept a clone of its ShardTx past its end; nothing was committed"
                    .to_owned(),
            );
        };
        // A step that handled the database's abort of its transaction
        // itself: tried again. One that swallowed a refusal returns `Ok` on
        // a transaction that can only roll back (see `Typed::apply`):
        // refused.
        if let Some(why) = ended_by_the_database(&tx) {
            let _ = tx.rollback().await;
            return Outcome::Later(why);
        }
        if let Some(reason) = tx.poison_reason() {
            let _ = tx.rollback().await;
            return Outcome::Refused(rollback_only(&reason));
        }
        // A step that swallowed a failed statement returns `Ok` on a
        // transaction the database already ended: its marker, read
        // back, proves the commit carries the work.
        let mark = marker(if undo { "undo" } else { "run" });
        let ended = match in_inbox(&tx, &mark).await {
            Ok(true) => None,
            Ok(false) => Some(String::from("its marker is gone")),
            Err(e) => Some(e.report().to_string()),
        };
        if let Some(cause) = ended {
            let _ = tx.rollback().await;
            return Outcome::Later(format!(
                "the step returned Ok on a transaction the database had ended; nothing was \
                 committed: {cause}"
            ));
        }
        match tx.commit().await {
            Ok(()) => Outcome::Done,
            Err(e) => Outcome::Later(e.report().to_string()),
        }
    }
}

/// A saga: steps, each a transaction on one key with its compensation,
/// started from a key of group `O` (where its state is kept) with data `D`.
///
/// A step's work or compensation gets the step's transaction and the
/// saga's data; returning an error of its own refuses the step (the saga
/// compensates), while an error of a shard that cannot be reached leaves
/// the saga to be resumed. A compensation must succeed in the end: it is
/// tried again, with a backoff, until it does.
pub struct Saga<O: EntityGroup, D> {
    name: &'static str,
    steps: Vec<Arc<dyn Step<D>>>,
    _origin: PhantomData<fn() -> O>,
}

impl<O: EntityGroup, D> Clone for Saga<O, D> {
    fn clone(&self) -> Self {
        Saga {
            name: self.name,
            steps: self.steps.clone(),
            _origin: PhantomData,
        }
    }
}

impl<O: EntityGroup, D> std::fmt::Debug for Saga<O, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saga")
            .field("name", &self.name)
            .field("steps", &self.steps.len())
            .finish()
    }
}

impl<O, D> Saga<O, D>
where
    O: EntityGroup,
    D: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    /// A saga named `name` (stable across releases, at most 128
    /// characters), with no step yet.
    pub fn new(name: &'static str) -> Self {
        Saga {
            name,
            steps: Vec::new(),
            _origin: PhantomData,
        }
    }

    /// Adds a step on the key `key` picks from the data, in group `G`:
    /// `run` does it, `undo` compensates it.
    pub fn step<G, K, R, RF, U, UF, E1, E2>(mut self, key: K, run: R, undo: U) -> Self
    where
        G: EntityGroup,
        K: Fn(&D) -> G::Key + Send + Sync + 'static,
        R: Fn(Arc<ShardTx<G>>, D) -> RF + Send + Sync + 'static,
        RF: Future<Output = std::result::Result<(), E1>> + Send + 'static,
        E1: Into<BoxError>,
        U: Fn(Arc<ShardTx<G>>, D) -> UF + Send + Sync + 'static,
        UF: Future<Output = std::result::Result<(), E2>> + Send + 'static,
        E2: Into<BoxError>,
    {
        let run = Arc::new(run);
        let undo = Arc::new(undo);
        self.steps.push(Arc::new(TypedStep::<G, D> {
            key: Arc::new(key),
            run: Arc::new(move |tx, d| {
                let f = run(tx, d);
                Box::pin(async move { f.await.map_err(Into::into) })
            }),
            undo: Arc::new(move |tx, d| {
                let f = undo(tx, d);
                Box::pin(async move { f.await.map_err(Into::into) })
            }),
        }));
        self
    }
}

impl Cluster {
    /// Starts and resumes sagas of `saga`'s definition (see [`Sagas`]).
    pub fn sagas<O, D>(&self, saga: Saga<O, D>) -> Sagas<O, D>
    where
        O: EntityGroup,
        D: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        Sagas {
            cluster: self.clone(),
            saga,
        }
    }

    /// Every saga whose state is kept on the shards (any name), unfinished
    /// ones only unless `finished`; at most 1,000 per shard.
    pub async fn saga_status(&self, finished: bool) -> Result<Vec<SagaStatus>> {
        let mut out = Vec::new();
        let listed = Listed {
            name: None,
            finished,
            due: None,
            limit: 1000,
        };
        for (status, _, _) in list(self, listed, None, false).await?.0 {
            out.push(status);
        }
        Ok(out)
    }
}

/// The sagas of one definition on a cluster ([`Cluster::sagas`]).
pub struct Sagas<O: EntityGroup, D> {
    cluster: Cluster,
    saga: Saga<O, D>,
}

impl<O: EntityGroup, D> Clone for Sagas<O, D> {
    fn clone(&self) -> Self {
        Sagas {
            cluster: self.cluster.clone(),
            saga: self.saga.clone(),
        }
    }
}

/// Whether a saga row of origin key `key_text` on `shard` is the one to
/// act on (the owner's, not a copy a bucket move left or made).
type Owned<'a> = &'a (dyn Fn(&str, &str) -> bool + Sync);

/// Which rows of `shardkit_sagas` [`list`] reads on each shard.
#[derive(Clone, Copy)]
struct Listed<'a> {
    /// Of this saga definition only.
    name: Option<&'a str>,
    /// Finished ones too.
    finished: bool,
    /// Only those whose wait is over at this time (ms), the longest
    /// waiting first: sagas still backing off do not fill the page.
    due: Option<i64>,
    /// At most this many per shard.
    limit: u64,
}

/// Rows of `shardkit_sagas` on every shard, as `listed` says: those
/// `owned` says are the owner's; without it, one row per saga (the one
/// changed last). With `skip_failed`, a shard that cannot be read is left
/// out (logged, and counted in the second value) instead of failing the
/// whole list.
async fn list(
    cluster: &Cluster,
    listed: Listed<'_>,
    owned: Option<Owned<'_>>,
    skip_failed: bool,
) -> Result<(Vec<(SagaStatus, String, i64)>, u64)> {
    let shards = cluster.shards();
    let mut out = Vec::new();
    let mut failed = 0;
    for i in 0..shards.topology().shards().len() as u32 {
        let id = ShardId(i);
        let shard = shards.shard_name(id);
        let mut q = Query::select();
        q.columns(SAGAS.names())
            .from(Alias::new(SAGAS.name))
            .limit(listed.limit);
        if let Some(name) = listed.name {
            q.and_where(Expr::col(Alias::new("name")).eq(name));
        }
        if !listed.finished {
            q.and_where(Expr::col(Alias::new("state")).is_in(["running", "compensating"]));
        }
        if let Some(now) = listed.due {
            q.and_where(Expr::col(Alias::new("next_at")).lte(now))
                .order_by(Alias::new("next_at"), sea_orm::Order::Asc);
        }
        let db = shards.side_conn(id);
        let read = shards
            .bounded(id, "saga", Some(Duration::from_secs(10)), async {
                db.query_all(&q)
                    .await
                    .map_err(|e| db_err(shard, SAGAS.name, "read", e))
            })
            .await;
        let rows = match read {
            Ok(rows) => rows,
            Err(e) if skip_failed => {
                tracing::warn!(shard, error = %e.report(), "sagas not read on this shard; they are driven at a later resume");
                failed += 1;
                continue;
            }
            Err(e) => return Err(e),
        };
        for r in rows {
            // A row this release cannot read (a state it does not know) is
            // left out of the list with a warning naming it, not the
            // whole list: `status` of its id says the same as an error.
            let row = match SagaStatus::read(&r) {
                Ok(row) => row,
                Err(e) => {
                    tracing::warn!(shard, error = %e, "a saga left out of the list");
                    continue;
                }
            };
            if owned.is_none_or(|owned| owned(&row.0.origin.1, shard)) {
                out.push(row);
            }
        }
    }
    if owned.is_none() {
        out.sort_by(|a, b| (&a.0.id, b.0.updated_at).cmp(&(&b.0.id, a.0.updated_at)));
        out.dedup_by(|later, first| later.0.id == first.0.id);
    }
    Ok((out, failed))
}

impl<O, D> Sagas<O, D>
where
    O: EntityGroup,
    D: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    fn what(&self, id: &str) -> String {
        format!("saga `{}` {id}", self.saga.name)
    }

    /// Starts a saga from `origin` with `data`: saves it (state `running`,
    /// step 0) in a transaction of `origin`, then drives it
    /// ([`drive`](Self::drive)). Returns its id and where it got to; a
    /// saga left waiting is finished by a later [`resume`](Self::resume).
    pub async fn start(&self, origin: O::Key, data: &D) -> Result<(String, SagaState)> {
        let id = crate::uuid_v7().to_string();
        if self.saga.steps.is_empty() || self.saga.name.is_empty() || self.saga.name.len() > 128 {
            return Err(ShardError::CrossKey {
                what: self.what(&id),
                reason: "a saga has a name of 1 to 128 characters and at least one step".to_owned(),
            });
        }
        let text = serde_json::to_string(data).map_err(|e| ShardError::CrossKey {
            what: self.what(&id),
            reason: format!("its data does not serialise: {e}"),
        })?;
        let now = self.cluster.shards().now_ms();
        let key_text = origin.to_directory_text();
        let (id_ref, text_ref, key_ref) = (&id, &text, &key_text);
        self.cluster
            .transaction::<O, _, _>(origin.clone(), |tx| async move {
                let q = Query::insert()
                    .into_table(Alias::new(SAGAS.name))
                    .columns(SAGAS.names())
                    .values_panic([
                        id_ref.as_str().into(),
                        O::NAME.into(),
                        key_ref.as_str().into(),
                        self.saga.name.into(),
                        0i32.into(),
                        "running".into(),
                        text_ref.as_str().into(),
                        0i32.into(),
                        0i64.into(),
                        now.into(),
                        now.into(),
                        Option::<String>::None.into(),
                    ])
                    .to_owned();
                tx.unchecked_connection()
                    .execute(&q)
                    .await
                    .map_err(|e| db_err(tx.shard(), SAGAS.name, "insert into", e))?;
                Ok(())
            })
            .await?;
        // Saved: from here on the saga exists, whatever driving it meets
        // (a caller that took an error for "not started" and started it
        // again would run it twice). Where it got to is read back when
        // driving failed; `Running` when even that fails.
        let state = match self.drive(origin.clone(), &id).await {
            Ok(state) => state,
            Err(e) => {
                tracing::debug!(saga = %id, error = %e.report(), "saga saved; driving it stopped, resume finishes it");
                self.status(origin, &id)
                    .await
                    .ok()
                    .flatten()
                    .map_or(SagaState::Running, |s| s.state)
            }
        };
        Ok((id, state))
    }

    /// Runs saga `id` (started from `origin`) as far as it goes now: its
    /// next steps, or its compensations, and saves each step's progress.
    /// Returns where it got to; a step that must wait (a shard down, a
    /// compensation that failed) leaves it for a later call.
    pub async fn drive(&self, origin: O::Key, id: &str) -> Result<SagaState> {
        let n = self.saga.steps.len() as i32;
        loop {
            let Some((status, data, next_at)) = self.load(origin.clone(), id).await? else {
                return Err(ShardError::CrossKey {
                    what: self.what(id),
                    reason: "no such saga on its origin's shard".to_owned(),
                });
            };
            if status.state.is_finished() || next_at > self.cluster.shards().now_ms() {
                return Ok(status.state);
            }
            let data: D = match serde_json::from_str(&data) {
                Ok(data) => data,
                Err(e) => {
                    let reason = format!(
                        "its stored data does not decode as `{}`: {e}",
                        std::any::type_name::<D>()
                    );
                    return Err(self.cannot_drive(&origin, &status, reason).await);
                }
            };
            let step = status.step;
            if step < 0 || step > n {
                let reason = format!(
                    "it is at step {step}, and this definition of `{}` has {n} steps: drive it \
                     with the definition that started it",
                    self.saga.name
                );
                return Err(self.cannot_drive(&origin, &status, reason).await);
            }
            let (next, outcome) = match status.state {
                SagaState::Running if step >= n => ((SagaState::Done, step), None),
                SagaState::Compensating if step <= 0 => ((SagaState::Compensated, 0), None),
                SagaState::Running => {
                    let i = step as usize;
                    match self.saga.steps[i]
                        .run(&self.cluster, id, i, &data, false)
                        .await
                    {
                        Outcome::Done => ((SagaState::Running, step + 1), None),
                        // Undo this step (it did not commit: its undo
                        // fences it) and every one before it.
                        Outcome::Refused(e) => ((SagaState::Compensating, step + 1), Some(e)),
                        Outcome::Later(e) => {
                            self.failed(&origin, id, &status, e).await?;
                            return Ok(SagaState::Running);
                        }
                    }
                }
                SagaState::Compensating => {
                    let i = (step - 1) as usize;
                    match self.saga.steps[i]
                        .run(&self.cluster, id, i, &data, true)
                        .await
                    {
                        Outcome::Done => ((SagaState::Compensating, step - 1), None),
                        Outcome::Refused(e) | Outcome::Later(e) => {
                            self.failed(&origin, id, &status, e).await?;
                            return Ok(SagaState::Compensating);
                        }
                    }
                }
                SagaState::Done | SagaState::Compensated => unreachable!("returned above"),
            };
            // Fault injection: the process dying before it saves the
            // saga's next step (`scope@n`: only before saving step `n`).
            if self
                .cluster
                .shards()
                .failpoint("shardkit::saga::before_save")
                .is_some_and(|step| step.is_empty() || step == next.1.to_string())
            {
                return Err(ShardError::CrossKey {
                    what: self.what(id),
                    reason: "stopped by the failpoint shardkit::saga::before_save".to_owned(),
                });
            }
            self.save(&origin, id, &status, next, outcome.or(status.error.clone()))
                .await?;
            if next.0 == SagaState::Compensated {
                crate::metrics::saga_compensated(self.saga.name);
            }
        }
    }

    /// Drives every unfinished saga of this definition whose wait is over,
    /// on every shard: on each, the longest waiting first, at most 1,000
    /// per resume (so sagas still backing off never crowd out the ones that
    /// are due). A shard that cannot be read is left for a later resume
    /// and counted in [`SagaReport::unreachable`]; the others' sagas are
    /// driven now.
    pub async fn resume(&self) -> Result<SagaReport> {
        let mut report = SagaReport::default();
        let owned = |key: &str, shard: &str| owned_by::<O>(&self.cluster, key, shard);
        let listed = Listed {
            name: Some(self.saga.name),
            finished: false,
            due: Some(self.cluster.shards().now_ms()),
            limit: 1000,
        };
        let (rows, unreachable) = list(&self.cluster, listed, Some(&owned), true).await?;
        report.unreachable = unreachable;
        for (status, _, _) in rows {
            let Some(origin) = O::Key::from_directory_text(&status.origin.1) else {
                continue;
            };
            match self.drive(origin, &status.id).await {
                Ok(SagaState::Done) => report.done += 1,
                Ok(SagaState::Compensated) => report.compensated += 1,
                Ok(_) => report.waiting += 1,
                Err(e) => {
                    tracing::debug!(saga = %status.id, error = %e.report(), "saga not resumed now");
                    report.waiting += 1;
                }
            }
        }
        Ok(report)
    }

    /// Gives saga `id` (started from `origin`) up, as an operator does
    /// with one whose step keeps being put off: a running saga starts
    /// compensating from the step it is at, as when that step is refused,
    /// with `aborted: {reason}` as its error. That step's undo runs first
    /// (it fences the step if the step never committed, and undoes it if
    /// it did), then the undos of the steps before it, at the next
    /// [`drive`](Self::drive) or [`resume`](Self::resume); this does not
    /// wait for them. A step that waits for its key's shard makes its undo
    /// wait there too.
    ///
    /// A saga already compensating is left as it is (`Compensating` is
    /// returned); one that finished, or whose steps all committed, is an
    /// error ([`ShardError::CrossKey`]). Another process driving the saga
    /// at once either saves its step first (the abort then applies from
    /// the step after) or finds the saga compensating.
    pub async fn abort(&self, origin: O::Key, id: &str, reason: &str) -> Result<SagaState> {
        let n = self.saga.steps.len() as i32;
        let refuse = |reason: String| ShardError::CrossKey {
            what: self.what(id),
            reason,
        };
        loop {
            let Some((status, _, _)) = self.load(origin.clone(), id).await? else {
                return Err(refuse("no such saga on its origin's shard".to_owned()));
            };
            let step = match status.state {
                SagaState::Compensating => return Ok(SagaState::Compensating),
                SagaState::Done | SagaState::Compensated => {
                    return Err(refuse(format!(
                        "it is {}: nothing is left to abort",
                        status.state.as_str()
                    )));
                }
                _ if status.name != self.saga.name => {
                    return Err(refuse(format!(
                        "it is a saga `{}`: abort it with that definition",
                        status.name
                    )));
                }
                SagaState::Running if status.step < 0 || status.step > n => {
                    return Err(refuse(format!(
                        "it is at step {}, and this definition of `{}` has {n} steps: abort it \
                         with the definition that started it",
                        status.step, self.saga.name
                    )));
                }
                SagaState::Running if status.step == n => {
                    return Err(refuse(format!(
                        "every one of its {n} steps committed: it finishes at its next drive"
                    )));
                }
                SagaState::Running => status.step,
            };
            let next = (SagaState::Compensating, step + 1);
            if self
                .save(
                    &origin,
                    id,
                    &status,
                    next,
                    Some(format!("aborted: {reason}")),
                )
                .await?
            {
                return Ok(SagaState::Compensating);
            }
            // Another process moved it meanwhile: from where it is now.
        }
    }

    /// Saga `id` as stored on `origin`'s shard.
    pub async fn status(&self, origin: O::Key, id: &str) -> Result<Option<SagaStatus>> {
        Ok(self.load(origin, id).await?.map(|(s, _, _)| s))
    }

    async fn load(&self, origin: O::Key, id: &str) -> Result<Option<(SagaStatus, String, i64)>> {
        self.cluster
            .transaction::<O, _, _>(origin, |tx| async move {
                let q = Query::select()
                    .columns(SAGAS.names())
                    .from(Alias::new(SAGAS.name))
                    .and_where(Expr::col(Alias::new("id")).eq(id))
                    .to_owned();
                let row = tx
                    .unchecked_connection()
                    .query_one(&q)
                    .await
                    .map_err(|e| db_err(tx.shard(), SAGAS.name, "read", e))?;
                row.map(|r| SagaStatus::read(&r))
                    .transpose()
                    .map_err(|e| db_err(tx.shard(), SAGAS.name, "read", e))
            })
            .await
    }

    /// Saves the step's progress, only if the saga is still where `was`
    /// found it (another process driving it at once saves first, or not).
    async fn save(
        &self,
        origin: &O::Key,
        id: &str,
        was: &SagaStatus,
        (state, step): (SagaState, i32),
        error: Option<String>,
    ) -> Result<bool> {
        self.update(
            origin,
            id,
            was,
            vec![
                ("state", state.as_str().into()),
                ("step", step.into()),
                ("attempts", 0i32.into()),
                ("next_at", 0i64.into()),
                (
                    "error",
                    error
                        .map(|e| crate::outbox::message::stored_error(&e).into_owned())
                        .into(),
                ),
            ],
        )
        .await
    }

    /// The error for a saga this definition cannot drive (its data does
    /// not decode, its step is not one of the definition's), recorded on
    /// the saga as a failed attempt: the saga says why, and waits its
    /// backoff, so that a [`resume`](Self::resume) pass (which reads the
    /// sagas due first) is not filled with it and reaches the others.
    async fn cannot_drive(&self, origin: &O::Key, was: &SagaStatus, reason: String) -> ShardError {
        if let Err(e) = self.failed(origin, &was.id, was, reason.clone()).await {
            tracing::debug!(saga = %was.id, error = %e.report(), "saga's failure not recorded");
        }
        ShardError::CrossKey {
            what: self.what(&was.id),
            reason,
        }
    }

    /// Records a failed attempt at the current step; the next after a
    /// backoff (200 ms doubled per attempt, at most 60 s).
    async fn failed(
        &self,
        origin: &O::Key,
        id: &str,
        was: &SagaStatus,
        error: String,
    ) -> Result<()> {
        let attempts = was.attempts.saturating_add(1);
        let wait = Ord::min(200i64 << (attempts - 1).clamp(0, 20), 60_000);
        tracing::debug!(saga = %id, attempts, %error, "saga step put off");
        let next_at = self.cluster.shards().now_ms() + wait;
        self.update(
            origin,
            id,
            was,
            vec![
                ("attempts", attempts.into()),
                ("next_at", next_at.into()),
                (
                    "error",
                    crate::outbox::message::stored_error(&error)
                        .into_owned()
                        .into(),
                ),
            ],
        )
        .await
        .map(drop)
    }

    /// Sets `values` (and `updated_at`) on saga `id` in a transaction of
    /// its origin, if it is still where `was` found it: whether it was.
    async fn update(
        &self,
        origin: &O::Key,
        id: &str,
        was: &SagaStatus,
        values: Vec<(&'static str, sea_orm::Value)>,
    ) -> Result<bool> {
        let now = self.cluster.shards().now_ms();
        let values = &values;
        self.cluster
            .transaction::<O, _, _>(origin.clone(), |tx| async move {
                let mut q = Query::update();
                q.table(Alias::new(SAGAS.name))
                    .value(Alias::new("updated_at"), now)
                    .and_where(Expr::col(Alias::new("id")).eq(id))
                    .and_where(Expr::col(Alias::new("state")).eq(was.state.as_str()))
                    .and_where(Expr::col(Alias::new("step")).eq(was.step));
                for (column, value) in values {
                    q.value(Alias::new(*column), value.clone());
                }
                let done = tx
                    .unchecked_connection()
                    .execute(&q)
                    .await
                    .map_err(|e| db_err(tx.shard(), SAGAS.name, "update", e))?;
                Ok(done.rows_affected() > 0)
            })
            .await
    }
}
