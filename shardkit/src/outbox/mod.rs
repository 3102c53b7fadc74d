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
