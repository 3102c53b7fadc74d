//! SeaORM's query traits on shardkit's reads.

use crate::entity::ShardedEntity;
use crate::read::find::Find;
use crate::read::in_tx::TxFind;
use crate::read::route::Keyed;
use sea_orm::sea_query::SelectStatement;
use sea_orm::{QueryFilter, QueryOrder, QuerySelect, QueryTrait};

macro_rules! select_traits {
    ($ty:ty, [$($generics:tt)*]) => {
        impl<$($generics)*> QueryOrder for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(std::borrow::BorrowMut::<sea_orm::Select<_>>::borrow_mut(&mut self.select))
            }
        }
        impl<$($generics)*> QuerySelect for $ty {
            type QueryStatement = SelectStatement;
            fn query(&mut self) -> &mut SelectStatement {
                QueryTrait::query(std::borrow::BorrowMut::<sea_orm::Select<_>>::borrow_mut(&mut self.select))
            }
        }
    };
}

impl<E: ShardedEntity, R> QueryFilter for Find<E, R> {
    type QueryStatement = SelectStatement;
    fn query(&mut self) -> &mut SelectStatement {
        QueryTrait::query(std::borrow::BorrowMut::<sea_orm::Select<_>>::borrow_mut(
            &mut self.select,
        ))
    }
}

// A single-key read runs as written, so every SeaORM ordering and selection
// method is safe on it; multi-shard reads take only what they can merge.
select_traits!(Find<E, Keyed<K>>, [E: ShardedEntity, K]);
select_traits!(TxFind<'t, E, C>, ['t, E: ShardedEntity, C]);

impl<E: ShardedEntity, C> QueryFilter for TxFind<'_, E, C> {
    type QueryStatement = SelectStatement;
    fn query(&mut self) -> &mut SelectStatement {
        QueryTrait::query(std::borrow::BorrowMut::<sea_orm::Select<_>>::borrow_mut(
            &mut self.select,
        ))
    }
}
