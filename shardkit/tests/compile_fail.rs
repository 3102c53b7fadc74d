//! What must not compile, with the message the user sees (`tests/ui/*.stderr`).
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p shardkit --test compile_fail`
//! after checking the new messages by eye.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
