//! A future boxed where it is built: what the public methods whose entity
//! must be of one group (writes, relation reads) return.
//!
//! Boxed because a concrete return type is what makes using another group's
//! entity fail to compile with one error: an `impl Future` return repeats
//! the failed bound at the call, in the opaque type and at its `.await`.

use futures::future::BoxFuture;
use std::future::Future;

/// `make()`'s future, boxed. The box is allocated first so that the
/// optimiser builds the future in it (a write's future is kilobytes; built
/// on the stack and moved, it would be copied each time; checked under
/// callgrind in release builds, BENCHMARKS.md).
#[inline(always)]
pub(crate) fn boxed<'a, F>(make: impl FnOnce() -> F) -> BoxFuture<'a, F::Output>
where
    F: Future + Send + 'a,
{
    let slot = Box::<F>::new_uninit();
    let built: Box<F> = Box::write(slot, make());
    Box::into_pin(built)
}
