//! Collects every attribute error of one derive so they are reported together
//! (serde_derive's `Ctxt`), instead of one per compile cycle.

use proc_macro2::TokenStream;
use quote::ToTokens;
use std::fmt::Display;

#[derive(Default)]
pub struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    pub fn error_spanned_by<T: ToTokens, M: Display>(&mut self, tokens: T, message: M) {
        self.errors.push(syn::Error::new_spanned(tokens, message));
    }

    pub fn syn_error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// `Ok(())` when nothing was reported, otherwise every error as one
    /// `compile_error!` stream.
    pub fn check(self) -> Result<(), TokenStream> {
        let mut errors = self.errors.into_iter();
        let Some(mut first) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            first.combine(error);
        }
        Err(first.to_compile_error())
    }
}
