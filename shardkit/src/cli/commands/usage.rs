//! Errors about a command-line option's value, told apart from errors
//! about the fleet (exit code 2 instead of 1).

use crate::error::ShardError;

/// Where a `--bucket` the group does not have is reported: an error naming
/// it is a usage error ([`is_usage`]).
pub(super) const USAGE_BUCKET: &str = "--bucket";

/// Whether `err` is about a command-line option's value (exit code 2, like
/// the errors of parsing the command line), not about the fleet.
pub(crate) fn is_usage(err: &ShardError) -> bool {
    matches!(err, ShardError::Config { entry, .. } if entry == USAGE_BUCKET)
}
