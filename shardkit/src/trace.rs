//! Span helpers shared by reads and writes.

use std::future::Future;
use tracing::Instrument;

/// Runs `fut` inside `span`, or bare when nothing listens to the span: an
/// instrumented future enters and leaves its span on every poll, which costs
/// a point read or a one-row write a visible share of its own CPU time even
/// with no subscriber.
pub(crate) async fn in_span<F: Future>(span: tracing::Span, fut: F) -> F::Output {
    if span.is_disabled() {
        fut.await
    } else {
        fut.instrument(span).await
    }
}
