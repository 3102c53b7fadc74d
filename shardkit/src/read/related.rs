//! What related reads return.

/// What `find_with_related` returns: each row of `E` with its related rows.
pub type WithRelated<E, R> = Vec<(
    <E as sea_orm::EntityTrait>::Model,
    Vec<<R as sea_orm::EntityTrait>::Model>,
)>;

/// What `find_also_related` returns: each row of `E` with its related row,
/// if any.
pub type AlsoRelated<E, R> = Vec<(
    <E as sea_orm::EntityTrait>::Model,
    Option<<R as sea_orm::EntityTrait>::Model>,
)>;
