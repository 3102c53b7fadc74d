//! [`Read`]: a read with its routing taken out, what planning, execution,
//! merging and move filtering share.

use crate::entity::{EntityGroup, ShardedEntity, table_name};
use crate::error::ShardFailure;
use crate::exec::{Consistency, Shards};
use crate::read::ReadGuard;
use crate::read::index::IndexLookup;
use crate::read::route::Gathered;
use sea_orm::Order;
use std::sync::Arc;
use std::time::Duration;

/// A read with its routing taken out: what every execution path shares.
pub(super) struct Read<E: ShardedEntity> {
    pub(super) shards: Shards,
    pub(super) index: Option<Arc<dyn IndexLookup>>,
    pub(super) guard: Option<Arc<dyn ReadGuard>>,
    pub(super) joined: Option<(std::any::TypeId, &'static str)>,
    pub(super) order: Vec<(E::Column, Order)>,
    pub(super) limit: Option<u64>,
    pub(super) offset: Option<u64>,
    pub(super) timeout: Option<Duration>,
    pub(super) concurrency: usize,
    pub(super) consistency: Consistency,
}

impl<E: ShardedEntity> Read<E> {
    pub(super) fn group() -> &'static str {
        <E::Group as EntityGroup>::NAME
    }

    pub(super) fn gathered(&self, asked: usize, failed: Vec<ShardFailure>) -> Gathered {
        Gathered {
            group: Self::group(),
            table: table_name::<E>(),
            asked,
            failed,
        }
    }
}
