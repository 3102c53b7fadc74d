//! Span helpers shared by reads and writes.

use std::future::Future;
use tracing::Instrument;

/// Runs `fut` inside `span`, or bare when nothing listens to the span: an
/// instrumented future enters and leaves its span on every poll, which costs
/// a point read or a one-row write a visible share of its own CPU time even
/// with no subscriber.
///
/// Not an `async fn`: one would hold `fut` twice (the argument and the
/// future it awaits), doubling the size of every write's boxed future.
pub(crate) fn in_span<F: Future>(
    span: tracing::Span,
    fut: F,
) -> futures::future::Either<F, tracing::instrument::Instrumented<F>> {
    if span.is_disabled() {
        futures::future::Either::Left(fut)
    } else {
        futures::future::Either::Right(fut.instrument(span))
    }
}
