//! Planning, running, resuming and aborting bucket moves.

mod catchup;
mod cutover;
mod hold;
mod ranges;
mod run;
mod schema;
mod status;

mod plan;

use crate::rebalance::mover::plan::{CATCH_UP, CLAIMS, MOVES, refused};
use crate::rebalance::mover::run::{copy_cursor, parse_copy_cursor};
pub(crate) use plan::LEASE_MS;
pub use plan::{AnyGroup, MovePhase, MovePlan, MoveProgress, MoveStatus, Rebalance};
pub use ranges::RangeSplit;
