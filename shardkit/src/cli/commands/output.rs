//! What a command hands back to be printed, and the look of its tables.

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};

/// What a command printed, and whether it found a problem.
pub(crate) struct Outcome {
    /// For `--json`.
    pub(crate) json: serde_json::Value,
    /// For a reader.
    pub(crate) text: String,
    /// Exit with 1 although the command ran (an unreachable shard, a
    /// difference found).
    pub(crate) problem: bool,
}

/// An empty table with `header`, in the commands' one style.
pub(super) fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED);
    table.set_header(header.iter().copied());
    table
}
