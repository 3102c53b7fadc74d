//! What each command does, and what it prints: one file per command,
//! [`dispatch`] choosing one, [`output`] the shape of what they print.

pub(super) mod dispatch;
mod explain;
mod gsi;
mod ids;
mod migrate;
mod outbox;
pub(super) mod output;
mod rebalance;
mod reference;
mod rollout;
mod route;
mod status;
pub(super) mod usage;
mod verify;
