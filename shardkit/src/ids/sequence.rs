//! A named sequence's blocks of ids (segments): handed out from memory,
//! the next block prefetched in the background.

use crate::error::{Result, ShardError};
use crate::ids::lock::lock;
use crate::ids::servers::Tickets;
use std::sync::{Arc, Mutex};

/// One named sequence's blocks.
pub struct Sequence {
    name: String,
    block: u64,
    tickets: Arc<Tickets>,
    state: Mutex<Segment>,
    /// Wakes the callers waiting for a block when a fetch ends.
    fetched: tokio::sync::Notify,
}

#[derive(Default)]
struct Segment {
    next: u64,
    end: u64,
    /// When `next` reaches this, the next block is fetched.
    prefetch_at: u64,
    ready: Option<(u64, u64)>,
    /// A ticket request for the next block is under way (a background
    /// prefetch, or a caller's own request).
    fetching: bool,
    /// Bumped by [`Ids::advance_past`](crate::ids::Ids::advance_past): a
    /// fetch that started before it throws its block away.
    epoch: u64,
    /// Failed fetches so far, and the last one's error: a caller that waited
    /// on a fetch that failed reports it instead of asking again.
    failures: u64,
    last_error: Option<FetchError>,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("name", &self.name)
            .field("block", &self.block)
            .finish()
    }
}

/// A sequence's one fetch under way (`fetching` set), ended when dropped
/// however it ends (done, failed, its caller went away, or its background
/// task was dropped before it ran: its runtime shut down), so a waiter can
/// take over. Never dropped with the sequence's state locked.
struct Fetching(Arc<Sequence>);

impl Drop for Fetching {
    fn drop(&mut self) {
        lock(&self.0.state).fetching = false;
        self.0.fetched.notify_waiters();
    }
}

/// What [`Sequence::next`] does after looking at the state.
enum Step<'a> {
    /// Hand out this id, and start the prefetch first when `true`.
    Id(u64, bool),
    /// The ready block was installed: look again.
    Again,
    /// Wait for the fetch under way (failures counted when it started).
    Wait(tokio::sync::futures::Notified<'a>, u64),
    /// No block and no fetch: fetch one.
    Fetch,
}

impl Sequence {
    /// Sequence `name`, `block` ids per ticket, drawing its tickets from
    /// `tickets`.
    pub(super) fn new(name: &str, block: u64, tickets: Arc<Tickets>) -> Self {
        Sequence {
            name: name.to_owned(),
            block,
            tickets,
            state: Mutex::new(Segment::default()),
            fetched: tokio::sync::Notify::new(),
        }
    }

    /// Ids per ticket.
    pub fn block(&self) -> u64 {
        self.block
    }

    /// The next id: from memory when the current block has one left; the
    /// database is only awaited when no block is buffered. With a block of 1
    /// (Flickr) every id is its own ticket request, and concurrent callers'
    /// requests run side by side, up to the ticket pools' size.
    pub async fn next(self: &Arc<Self>) -> Result<i64> {
        if self.block == 1 {
            let ticket = self.tickets.ticket(&self.name).await?;
            return self.block_of(ticket).map(|(start, _)| start as i64);
        }
        loop {
            let step = {
                let mut st = lock(&self.state);
                if st.next < st.end {
                    let id = st.next;
                    st.next += 1;
                    let prefetch = st.next >= st.prefetch_at && st.ready.is_none() && !st.fetching;
                    if prefetch {
                        st.fetching = true;
                    }
                    Step::Id(id, prefetch)
                } else if let Some((start, end)) = st.ready.take() {
                    st.next = start;
                    st.end = end;
                    st.prefetch_at = start + (self.block / 10).max(1);
                    Step::Again
                } else if st.fetching {
                    // Registered before the lock is released (a `Notified`
                    // gets `notify_waiters` from its creation on), so the
                    // fetch's wake-up cannot be missed.
                    Step::Wait(self.fetched.notified(), st.failures)
                } else {
                    st.fetching = true;
                    Step::Fetch
                }
            };
            match step {
                Step::Id(id, prefetch) => {
                    if prefetch {
                        // Claimed above, spawned with the lock released: a
                        // runtime shutting down drops the task at once, and
                        // its claim's end locks the state.
                        let claim = Fetching(Arc::clone(self));
                        // The task holds the sequence only while its one
                        // request lasts (at most `timeout_ms` per server).
                        tokio::spawn(async move {
                            let seq = Arc::clone(&claim.0);
                            if let Err(err) = seq.fetch(claim).await {
                                tracing::warn!(sequence = %seq.name, error = %err.report(), "prefetching the next block failed; the next caller that needs it asks again");
                            }
                        });
                    }
                    return Ok(id as i64);
                }
                Step::Again => {}
                Step::Fetch => self.fetch(Fetching(Arc::clone(self))).await?,
                Step::Wait(notified, failures) => {
                    notified.await;
                    // The fetch this caller waited on failed: report it
                    // rather than queue up behind the same dead servers.
                    let st = lock(&self.state);
                    if st.failures != failures
                        && st.ready.is_none()
                        && st.next >= st.end
                        && let Some(error) = &st.last_error
                    {
                        return Err(self.replay_error(error));
                    }
                }
            }
        }
    }

    /// Asks for a ticket and installs its block as the ready one. The caller
    /// has set `fetching`.
    async fn fetch(&self, _done: Fetching) -> Result<()> {
        let epoch = lock(&self.state).epoch;
        let result = self
            .tickets
            .ticket(&self.name)
            .await
            .and_then(|ticket| self.block_of(ticket));
        let mut st = lock(&self.state);
        match result {
            Ok(block) => {
                if st.epoch == epoch {
                    st.ready = Some(block);
                }
                Ok(())
            }
            Err(err) => {
                st.failures += 1;
                st.last_error = Some(recordable(&err));
                Err(err)
            }
        }
    }

    /// The ids ticket `ticket` reserves, `[t·B, (t+1)·B)`; refused when they
    /// would not fit in an `i64`.
    fn block_of(&self, ticket: u64) -> Result<(u64, u64)> {
        ticket
            .checked_mul(self.block)
            .and_then(|start| Some((start, start.checked_add(self.block)?)))
            .filter(|&(_, end)| end - 1 <= i64::MAX as u64)
            .ok_or_else(|| ShardError::SequenceExhausted {
                sequence: self.name.clone(),
                ticket,
                block: self.block,
            })
    }

    /// Forgets the buffered blocks (and any block a fetch under way brings).
    pub(super) fn discard_blocks(&self) {
        let mut st = lock(&self.state);
        st.next = 0;
        st.end = 0;
        st.prefetch_at = 0;
        st.ready = None;
        st.epoch += 1;
    }
}

/// A failed fetch, kept to be reported to every caller that waited on it.
enum FetchError {
    /// A [`ShardError::Config`] (no such sequence).
    Config { entry: String, message: String },
    /// A [`ShardError::SequenceExhausted`].
    Exhausted { ticket: u64, block: u64 },
    /// The causes of an [`ShardError::IdsUnavailable`], and its source.
    Unavailable(String, Option<std::sync::Arc<ShardError>>),
}

fn recordable(err: &ShardError) -> FetchError {
    match err {
        ShardError::Config { entry, message } => FetchError::Config {
            entry: entry.clone(),
            message: message.clone(),
        },
        ShardError::SequenceExhausted { ticket, block, .. } => FetchError::Exhausted {
            ticket: *ticket,
            block: *block,
        },
        ShardError::IdsUnavailable { causes, last, .. } => {
            FetchError::Unavailable(causes.clone(), last.clone())
        }
        other => FetchError::Unavailable(other.to_string(), None),
    }
}

impl Sequence {
    fn replay_error(&self, error: &FetchError) -> ShardError {
        match error {
            FetchError::Config { entry, message } => {
                ShardError::config(entry.clone(), message.clone())
            }
            FetchError::Exhausted { ticket, block } => ShardError::SequenceExhausted {
                sequence: self.name.clone(),
                ticket: *ticket,
                block: *block,
            },
            FetchError::Unavailable(causes, last) => ShardError::IdsUnavailable {
                sequence: self.name.clone(),
                causes: causes.clone(),
                last: last.clone(),
            },
        }
    }
}
