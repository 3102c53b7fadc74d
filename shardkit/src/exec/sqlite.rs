//! SQLite's one writer per file, for a cluster of several SQLite files and
//! several instances (processes, or two `Cluster`s in one) on them.
//!
//! A SQLite write transaction holds its file's write lock from `begin`
//! (`BEGIN IMMEDIATE`), and a write of one shard may need another file's
//! lock (its global-index rows, a rollout's index rows, a repair's target).
//! Two such transactions on two files would each wait for the other's lock
//! until the busy timeout failed one with `database is locked`. So the write
//! transactions on a cluster's SQLite files take one *write slot* first: a
//! queue inside the process (fair, first come first served) and, across
//! processes, an advisory lock on a file beside the first SQLite shard
//! (`<file>.shardkit-write.lock`; never the database file itself, whose
//! locks are SQLite's). Waiting for the slot is bounded by the busy timeout,
//! like waiting for SQLite's own lock; a wait that runs out is SQLite's
//! `database is locked` ([`Synthetic::sqlite_slot`]).

use crate::error::Synthetic;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// SQLite's busy timeout, set on every connection shardkit opens to a
/// SQLite file: how long a statement waits for another connection's lock
/// before failing with `database is locked`. Waits for the cluster's write
/// slot and, on SQLite, for a pooled connection (unless
/// `[pool] acquire_timeout_secs` says otherwise) are bounded by it too.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// At most this many rows per transaction of a long job (a rollout's
/// backfill) on SQLite: each holds the file's write lock and the write slot
/// while it runs, and the writers of every instance wait for it.
pub(crate) const LONG_JOB_CHUNK: u64 = 100;

/// How often a writer waiting for another process's hold of the slot looks
/// again, at most.
const LOCK_POLL_MAX: Duration = Duration::from_millis(2);

/// The write slot of a cluster's SQLite files (see the module's text).
pub(crate) struct WriterSlot {
    gate: Arc<Semaphore>,
    /// The lock file shared with other instances, when there is one.
    file: Option<Arc<File>>,
    wait: Duration,
}

/// The slot, held until dropped (with the transaction it guards).
pub(crate) struct WriterPermit {
    file: Option<Arc<File>>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for WriterPermit {
    fn drop(&mut self) {
        // Before the permit (dropped after this): the next writer of this
        // process finds the file free.
        if let Some(file) = &self.file {
            let _ = file.unlock();
        }
    }
}

impl WriterSlot {
    /// The slot of a cluster whose first file-backed SQLite shard is at
    /// `first` (none: every SQLite shard is in memory, private to the
    /// process). A lock file that cannot be opened (a read-only directory)
    /// leaves the slot to this process, with a warning.
    pub(crate) fn new(first: Option<&Path>, wait: Duration) -> WriterSlot {
        let file = first.and_then(|db| {
            let path = lock_path(db);
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
            {
                Ok(file) => Some(Arc::new(file)),
                Err(err) => {
                    tracing::warn!(
                        path = %path.display(),
                        error = %err,
                        "cannot open the SQLite write slot's lock file: write transactions of \
                         other processes on these files are not queued with this one's"
                    );
                    None
                }
            }
        });
        WriterSlot {
            gate: Arc::new(Semaphore::new(1)),
            file,
            wait,
        }
    }

    /// Waits for the slot, at most the busy timeout; after that, SQLite's
    /// `database is locked` ([`Synthetic::sqlite_slot`]).
    pub(crate) async fn acquire(&self) -> Result<WriterPermit, sea_orm::DbErr> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let busy = || Synthetic::sqlite_slot(self.wait);
        let permit = tokio::time::timeout_at(deadline, Arc::clone(&self.gate).acquire_owned())
            .await
            .ok()
            .and_then(|p| p.ok())
            .ok_or_else(busy)?;
        let Some(file) = &self.file else {
            return Ok(WriterPermit {
                file: None,
                _permit: permit,
            });
        };
        let mut pause = Duration::from_micros(250);
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) => {
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        return Err(busy());
                    }
                    tokio::time::sleep(pause.min(deadline - now)).await;
                    pause = (pause * 2).min(LOCK_POLL_MAX);
                }
                Err(std::fs::TryLockError::Error(err)) => {
                    // A file system without locks: this process's queue
                    // still orders its own writers.
                    tracing::warn!(error = %err, "cannot lock the SQLite write slot's lock file");
                    return Ok(WriterPermit {
                        file: None,
                        _permit: permit,
                    });
                }
            }
        }
        Ok(WriterPermit {
            file: Some(Arc::clone(file)),
            _permit: permit,
        })
    }
}

/// The lock file beside SQLite database `db`.
pub(crate) fn lock_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".shardkit-write.lock");
    PathBuf::from(name)
}

/// The file a SQLite URL names, made absolute (instances started in other
/// directories name it the same), or `None` for an in-memory database or a
/// URL SQLx cannot read.
pub(crate) fn database_file(url: &crate::topology::DatabaseUrl) -> Option<PathBuf> {
    use std::str::FromStr;
    if url.scheme() != Some("sqlite") || url.is_sqlite_in_memory() {
        return None;
    }
    let options = sea_orm::sqlx::sqlite::SqliteConnectOptions::from_str(url.expose()).ok()?;
    let path = options.get_filename();
    Some(std::fs::canonicalize(path).unwrap_or_else(|_| {
        std::env::current_dir()
            .map(|dir| dir.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    }))
}
