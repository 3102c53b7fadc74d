//! Code generation. Every generated path is fully qualified (`::shardkit::...`,
//! `::core::...`) so user imports cannot change its meaning.

use crate::ast::{self, Group, Sharded};
use crate::ctxt::Ctxt;
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::DeriveInput;
use syn::spanned::Spanned;

pub fn entity_group(input: &DeriveInput) -> Result<TokenStream, TokenStream> {
    let mut cx = Ctxt::default();
    let group = Group::from_syn(&mut cx, input);
    cx.check()?;
    let Some(Group { ident, key, name }) = group else {
        return Ok(TokenStream::new());
    };
    let key_span = key.span();
    let key_type_def = quote_spanned!(key_span=> type Key = #key;);
    Ok(quote! {
        impl ::shardkit::EntityGroup for #ident {
            #key_type_def
            const NAME: &'static str = #name;
        }
        impl ::shardkit::GroupKey<#ident> for #key {
            #[inline]
            fn into_group_key(self) -> Self {
                self
            }
        }
    })
}

pub fn sharded(input: &DeriveInput) -> Result<TokenStream, TokenStream> {
    // `#[sea_orm::model]` repeats every derive on the generated `ModelEx`; the
    // entity is described once, by `Model`.
    if input.ident == "ModelEx" {
        return Ok(TokenStream::new());
    }
    let mut cx = Ctxt::default();
    if ast::reference(&mut cx, input) {
        cx.check()?;
        return Ok(reference());
    }
    let sharded = Sharded::from_syn(&mut cx, input);
    let variant = match &sharded {
        Some(s) => match ast::column_variant(s.shard_key.field) {
            Ok(v) => Some(v),
            Err(err) => {
                cx.syn_error(err);
                None
            }
        },
        None => None,
    };
    cx.check()?;
    let id_variant = match sharded.as_ref().and_then(|s| s.id.as_ref()) {
        Some(id) => match ast::column_variant(id.field) {
            Ok(v) => Some(v),
            Err(err) => return Err(err.to_compile_error()),
        },
        None => None,
    };
    let mut index_items = Vec::new();
    for (field, unique) in sharded.iter().flat_map(|s| s.indexes.iter()) {
        match ast::column_variant(field) {
            Ok(v) => index_items.push(quote!((Column::#v, #unique))),
            Err(err) => return Err(err.to_compile_error()),
        }
    }
    let (
        Some(Sharded {
            group,
            shard_key,
            id,
            ..
        }),
        Some(variant),
    ) = (sharded, variant)
    else {
        return Ok(TokenStream::new());
    };
    let index_items = if index_items.is_empty() {
        quote!()
    } else {
        quote! {
            const GLOBAL_INDEXES: &'static [(Column, bool)] = &[#(#index_items),*];
        }
    };
    let id_items = match (id, id_variant) {
        (Some(id), Some(id_variant)) => {
            let strategy = match &id.strategy {
                ast::IdStrategy::Ticket(seq) => quote!(::shardkit::ids::IdStrategy::Ticket(#seq)),
                ast::IdStrategy::Encoded(seq) => {
                    quote!(::shardkit::ids::IdStrategy::Encoded(#seq))
                }
                ast::IdStrategy::UuidV7 => quote!(::shardkit::ids::IdStrategy::UuidV7),
                ast::IdStrategy::Snowflake => quote!(::shardkit::ids::IdStrategy::Snowflake),
            };
            quote! {
                const ID: ::core::option::Option<(Column, ::shardkit::ids::IdStrategy)> =
                    ::core::option::Option::Some((Column::#id_variant, #strategy));
            }
        }
        _ => quote!(),
    };
    let model = &input.ident;
    let field = shard_key.ident;
    let ty = shard_key.ty;
    let column_name = {
        let raw = field.to_string();
        raw.strip_prefix("r#").unwrap_or(&raw).to_owned()
    };
    let key = quote!(<#group as ::shardkit::EntityGroup>::Key);
    // Spanned on the field's type so a mismatch points at the user's field.
    let cast = quote_spanned! {ty.span()=>
        #[inline]
        fn __shardkit_key(value: #ty) -> #key {
            <#ty as ::shardkit::GroupKey<#group>>::into_group_key(value)
        }
    };
    Ok(quote! {
        const _: () = {
            #cast

            impl ::shardkit::ShardedEntity for Entity {
                type Group = #group;
                const SHARD_KEY_FIELD: &'static str = #column_name;
                #id_items
                #index_items

                #[inline]
                fn shard_key_column() -> Column {
                    Column::#variant
                }

                #[inline]
                fn shard_key(model: &#model) -> #key {
                    __shardkit_key(::core::clone::Clone::clone(&model.#field))
                }

                #[inline]
                fn active_shard_key(model: &ActiveModel) -> ::core::option::Option<#key> {
                    ::shardkit::__private::active_value(&model.#field).map(__shardkit_key)
                }

                #[inline]
                fn __try_into_model(
                    model: ActiveModel,
                ) -> ::core::result::Result<#model, ::shardkit::sea_orm::DbErr> {
                    ::shardkit::sea_orm::TryIntoModel::try_into_model(model)
                }
            }

            impl ::shardkit::InGroup<#group> for Entity {}

            impl ::shardkit::Joinable<#group> for Entity {
                #[inline]
                fn __key_column() -> ::core::option::Option<Column> {
                    ::core::option::Option::Some(Column::#variant)
                }
            }
        };
    })
}

/// `#[shardkit(reference)]`: a table with a copy on every shard.
fn reference() -> TokenStream {
    quote! {
        const _: () = {
            impl ::shardkit::ReferenceEntity for Entity {}

            impl<G: ::shardkit::EntityGroup> ::shardkit::Joinable<G> for Entity {
                const __REFERENCE: ::core::option::Option<
                    &'static dyn ::shardkit::__private::ReferenceTable,
                > = ::core::option::Option::Some(
                    &::shardkit::reference::Typed::<Entity>::NEW,
                );

                #[inline]
                fn __key_column() -> ::core::option::Option<Column> {
                    ::core::option::Option::None
                }
            }
        };
    }
}
