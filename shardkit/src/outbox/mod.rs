//! Work that spans keys: a transactional outbox whose messages are applied
//! exactly once on the receiving key ([`Outbox`]), sagas with compensation
//! ([`Saga`]), and idempotent requests
//! ([`Cluster::transaction_once`](crate::Cluster::transaction_once)).
//!
//! shardkit refuses a write that spans keys. Work that must change two keys
//! is split into transactions of one key each, linked by messages written
//! in the sender's transaction: see `shardkit::guide::outbox`.

mod message;
mod once;
mod relay;
mod saga;
mod send;

pub use message::{BoxError, Message};
pub use once::REQUEST_TTL;
pub use relay::{
    INBOX_TTL, Outbox, OutboxStatus, ParkedMessage, RelayReport, RelayTask, ShardOutbox,
};
pub use saga::{Saga, SagaReport, SagaState, SagaStatus, Sagas};
