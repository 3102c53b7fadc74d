//! The two inputs the derives understand, parsed and validated in one place.

use crate::ctxt::Ctxt;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, LitStr, Path, Type};

/// `#[derive(EntityGroup)]` input.
pub struct Group<'a> {
    pub ident: &'a Ident,
    pub key: Type,
    pub name: String,
}

/// `#[derive(Sharded)]` input.
pub struct Sharded<'a> {
    pub group: Path,
    pub shard_key: ShardKeyField<'a>,
    pub id: Option<IdField<'a>>,
    /// `#[shardkit(global_index)]` fields, with whether the index is unique.
    pub indexes: Vec<(&'a syn::Field, bool)>,
}

/// A primary key field shardkit fills on insert.
pub struct IdField<'a> {
    pub field: &'a syn::Field,
    pub strategy: IdStrategy,
}

pub enum IdStrategy {
    Ticket(String),
    UuidV7,
    Snowflake,
    Encoded(String),
}

pub struct ShardKeyField<'a> {
    pub ident: &'a Ident,
    pub ty: &'a Type,
    pub field: &'a syn::Field,
}

const GROUP_KEYS: &str = "`key = Type`, `name = \"...\"`";
const ENTITY_KEYS: &str = "`group = path::To::Group`, `reference`";
const FIELD_KEYS: &str = "`shard_key`, `global_index`, `global_index(unique)`, `id = \"ticket:<sequence>\" | \"encoded:<sequence>\" | \"uuid_v7\" | \"snowflake\"`";

impl<'a> Group<'a> {
    pub fn from_syn(cx: &mut Ctxt, input: &'a DeriveInput) -> Option<Self> {
        if !input.generics.params.is_empty() {
            cx.error_spanned_by(
                &input.generics,
                "an entity group is a plain marker type: remove the generic parameters \
                 (write `pub struct Customer;`)",
            );
        }
        let mut key: Option<Type> = None;
        let mut name: Option<LitStr> = None;
        for attr in input.attrs.iter().filter(|a| a.path().is_ident("shardkit")) {
            let result = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("key") {
                    let ty: Type = meta.value()?.parse()?;
                    if key.is_some() {
                        cx.error_spanned_by(&meta.path, "duplicate shardkit attribute `key`");
                    }
                    key = Some(ty);
                } else if meta.path.is_ident("name") {
                    let lit: LitStr = meta.value()?.parse()?;
                    if name.is_some() {
                        cx.error_spanned_by(&meta.path, "duplicate shardkit attribute `name`");
                    }
                    if lit.value().is_empty() {
                        cx.error_spanned_by(&lit, "the group name must not be empty");
                    }
                    name = Some(lit);
                } else {
                    cx.error_spanned_by(
                        &meta.path,
                        format!(
                            "unknown shardkit group attribute `{}`; expected one of {GROUP_KEYS}",
                            path_to_string(&meta.path)
                        ),
                    );
                    skip_meta_value(&meta)?;
                }
                Ok(())
            });
            if let Err(err) = result {
                cx.syn_error(err);
            }
        }
        if let Some(Type::Path(tp)) = &key
            && is_option(tp)
        {
            cx.error_spanned_by(
                tp,
                "a shard key cannot be optional: every row must name its shard; \
                 write the key type without `Option<...>`, e.g. `#[shardkit(key = i64)]`",
            );
        }
        let Some(key) = key else {
            cx.error_spanned_by(
                input,
                "missing the group's shard key type: add `#[shardkit(key = i64)]` \
                 (supported: i64, i32, u64, String, uuid::Uuid)",
            );
            return None;
        };
        Some(Group {
            ident: &input.ident,
            key,
            name: name.map_or_else(|| input.ident.to_string(), |lit| lit.value()),
        })
    }
}

/// Whether the model says `#[shardkit(reference)]`: a reference table,
/// which takes no other shardkit attribute (each one used is an error).
pub fn reference(cx: &mut Ctxt, input: &DeriveInput) -> bool {
    let mut reference = false;
    let mut others: Vec<Path> = Vec::new();
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("shardkit")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("reference") {
                reference = true;
            } else {
                others.push(meta.path.clone());
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
    }
    if !reference {
        return false;
    }
    for path in &others {
        cx.error_spanned_by(
            path,
            format!(
                "a reference table has a copy on every shard and belongs to no group: remove `{}`",
                path_to_string(path)
            ),
        );
    }
    if let Data::Struct(data) = &input.data {
        for field in &data.fields {
            for attr in field.attrs.iter().filter(|a| a.path().is_ident("shardkit")) {
                cx.error_spanned_by(
                    attr,
                    "a reference table has no shard key, global index or generated id: \
                     remove this `#[shardkit(...)]`",
                );
            }
        }
    }
    true
}

impl<'a> Sharded<'a> {
    pub fn from_syn(cx: &mut Ctxt, input: &'a DeriveInput) -> Option<Self> {
        let fields = match &input.data {
            Data::Struct(data) => match &data.fields {
                Fields::Named(named) => &named.named,
                _ => {
                    cx.error_spanned_by(
                        input,
                        "#[derive(Sharded)] goes on a SeaORM `Model` struct with named fields",
                    );
                    return None;
                }
            },
            _ => {
                cx.error_spanned_by(
                    input,
                    "#[derive(Sharded)] goes on a SeaORM `Model` struct, not an enum or union",
                );
                return None;
            }
        };

        let mut group: Option<Path> = None;
        for attr in input.attrs.iter().filter(|a| a.path().is_ident("shardkit")) {
            let result = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("group") {
                    let path: Path = meta.value()?.parse()?;
                    if group.is_some() {
                        cx.error_spanned_by(&meta.path, "duplicate shardkit attribute `group`");
                    }
                    group = Some(path);
                } else if meta.path.is_ident("reference") {
                    // Handled by `reference`.
                } else {
                    cx.error_spanned_by(
                        &meta.path,
                        format!(
                            "unknown shardkit entity attribute `{}`; expected {ENTITY_KEYS}",
                            path_to_string(&meta.path)
                        ),
                    );
                    skip_meta_value(&meta)?;
                }
                Ok(())
            });
            if let Err(err) = result {
                cx.syn_error(err);
            }
        }

        let mut keys: Vec<ShardKeyField<'a>> = Vec::new();
        let mut id: Option<IdField<'a>> = None;
        let mut indexes: Vec<(&'a syn::Field, bool)> = Vec::new();
        for field in fields {
            let mut is_key = false;
            for attr in field.attrs.iter().filter(|a| a.path().is_ident("shardkit")) {
                let result = attr.parse_nested_meta(|meta| {
                    if meta.path.is_ident("shard_key") {
                        if is_key {
                            cx.error_spanned_by(
                                &meta.path,
                                "duplicate shardkit attribute `shard_key`",
                            );
                        }
                        is_key = true;
                    } else if meta.path.is_ident("global_index") {
                        let mut unique = false;
                        if meta.input.peek(syn::token::Paren) {
                            meta.parse_nested_meta(|inner| {
                                if inner.path.is_ident("unique") {
                                    unique = true;
                                    Ok(())
                                } else {
                                    Err(inner.error("unknown global_index option; expected `unique`"))
                                }
                            })?;
                        }
                        if indexes.iter().any(|(f, _)| std::ptr::eq(*f, field)) {
                            cx.error_spanned_by(&meta.path, "duplicate shardkit attribute `global_index`");
                        }
                        indexes.push((field, unique));
                    } else if meta.path.is_ident("id") {
                        let lit: LitStr = meta.value()?.parse()?;
                        let value = lit.value();
                        let sequence = value
                            .strip_prefix("ticket:")
                            .map(|s| (s, false))
                            .or_else(|| value.strip_prefix("encoded:").map(|s| (s, true)));
                        let strategy = if let Some((seq, encoded)) = sequence {
                            if seq.is_empty()
                                || seq.len() > 48
                                || !seq.chars().all(|c| {
                                    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
                                })
                            {
                                cx.error_spanned_by(
                                    &lit,
                                    "a sequence name is 1-48 ASCII lowercase letters, digits and `_`",
                                );
                            }
                            Some(if encoded {
                                IdStrategy::Encoded(seq.to_owned())
                            } else {
                                IdStrategy::Ticket(seq.to_owned())
                            })
                        } else if value == "uuid_v7" {
                            Some(IdStrategy::UuidV7)
                        } else if value == "snowflake" {
                            Some(IdStrategy::Snowflake)
                        } else {
                            cx.error_spanned_by(
                                &lit,
                                "unknown id generator; expected \"ticket:<sequence>\", \"encoded:<sequence>\", \"uuid_v7\" or \"snowflake\"",
                            );
                            None
                        };
                        if !is_primary_key(field) {
                            cx.error_spanned_by(
                                &meta.path,
                                "`id = ...` fills the primary key: put it on the `#[sea_orm(primary_key)]` field",
                            );
                        }
                        if id.is_some() {
                            cx.error_spanned_by(&meta.path, "only one field can have a generated id");
                        }
                        if let Some(strategy) = strategy {
                            id = Some(IdField { field, strategy });
                        }
                    } else {
                        cx.error_spanned_by(
                            &meta.path,
                            format!(
                                "unknown shardkit field attribute `{}`; expected {FIELD_KEYS}",
                                path_to_string(&meta.path)
                            ),
                        );
                        skip_meta_value(&meta)?;
                    }
                    Ok(())
                });
                if let Err(err) = result {
                    cx.syn_error(err);
                }
            }
            if is_key && let Some(ident) = &field.ident {
                keys.push(ShardKeyField {
                    ident,
                    ty: &field.ty,
                    field,
                });
            }
        }

        if group.is_none() {
            cx.error_spanned_by(
                &input.ident,
                "missing the entity group: add `#[shardkit(group = crate::YourGroup)]`, \
                 naming a type that derives `shardkit::EntityGroup`",
            );
        }
        match keys.len() {
            0 => cx.error_spanned_by(
                &input.ident,
                "missing the shard key: mark exactly one field with `#[shardkit(shard_key)]`",
            ),
            1 => {}
            _ => {
                for extra in &keys[1..] {
                    cx.error_spanned_by(
                        extra.ident,
                        format!(
                            "a sharded entity has exactly one shard key, but `{}` is marked \
                             too (first: `{}`); remove one `#[shardkit(shard_key)]`",
                            extra.ident, keys[0].ident
                        ),
                    );
                }
            }
        }
        if let Some(key) = keys.first()
            && let Type::Path(tp) = key.ty
            && is_option(tp)
        {
            cx.error_spanned_by(
                key.ty,
                format!(
                    "the shard key `{}` cannot be nullable: a row without a shard key belongs \
                     to no shard; make the column `NOT NULL` and drop the `Option<...>`",
                    key.ident
                ),
            );
        }
        let group = group?;
        let shard_key = keys.into_iter().next()?;
        Some(Sharded {
            group,
            shard_key,
            id,
            indexes,
        })
    }
}

fn is_primary_key(field: &syn::Field) -> bool {
    let mut found = false;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("sea_orm")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("primary_key") {
                found = true;
            } else {
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
    }
    found
}

fn is_option(tp: &syn::TypePath) -> bool {
    tp.qself.is_none()
        && tp
            .path
            .segments
            .last()
            .is_some_and(|seg| seg.ident == "Option")
}

fn path_to_string(path: &Path) -> String {
    path.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

/// Consumes `= value` or `(...)` after an unknown key so parsing can go on and
/// report every problem in one pass.
fn skip_meta_value(meta: &syn::meta::ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: proc_macro2::TokenStream = {
            let value = meta.value()?;
            let mut tokens = proc_macro2::TokenStream::new();
            while !value.is_empty() && !value.peek(syn::Token![,]) {
                let tt: proc_macro2::TokenTree = value.parse()?;
                tokens.extend(std::iter::once(tt));
            }
            tokens
        };
    } else if meta.input.peek(syn::token::Paren) {
        let _content;
        syn::parenthesized!(_content in meta.input);
    }
    Ok(())
}

/// The variant `DeriveEntityModel` generates in `Column` for a field:
/// `customer_id` → `CustomerId` (heck's upper camel case, as SeaORM does), or the
/// field's `#[sea_orm(enum_name = "...")]` when it has one.
pub fn column_variant(field: &syn::Field) -> syn::Result<Ident> {
    use heck::ToUpperCamelCase;
    let mut enum_name: Option<String> = None;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("sea_orm")) {
        // Only `enum_name` matters here; every other sea_orm key is SeaORM's own.
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("enum_name") {
                let lit: LitStr = meta.value()?.parse()?;
                enum_name = Some(lit.value());
            } else {
                skip_meta_value(&meta)?;
            }
            Ok(())
        });
    }
    let ident = field
        .ident
        .as_ref()
        .ok_or_else(|| syn::Error::new(field.span(), "unnamed field"))?;
    let name = match enum_name {
        Some(name) => name,
        None => {
            let raw = ident.to_string();
            raw.strip_prefix("r#").unwrap_or(&raw).to_upper_camel_case()
        }
    };
    syn::parse_str::<Ident>(&name).map(|mut id| {
        id.set_span(ident.span());
        id
    })
}
