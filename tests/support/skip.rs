//! Tests that cannot run on this machine (a kernel without a system call they need, no
//! permission to mount): such a test fails, unless the environment says that skipping it is
//! expected here. Then it prints `SKIPPED` with the reason. A test that returned early in
//! silence would pass without having checked anything.

/// Reports that the calling test (or case) cannot run here, for the reason `why`: panics unless
/// the environment variable `allow` is set (the message names it), else prints
/// `SKIPPED (allow): why`. The caller then skips what it cannot run.
pub fn skip_unless_allowed(allow: &str, why: &str) {
    assert!(
        std::env::var_os(allow).is_some(),
        "{why}; set {allow}=1 to skip this"
    );
    eprintln!("SKIPPED ({allow}): {why}");
}

/// Whether the daemon under test has its test hooks (`MQBLK_TEST_ONLY_*`, debug builds only);
/// in a release build the calling test fails, unless `MQBLK_TEST_ALLOW_RELEASE_BUILD` says
/// that skipping it is expected.
pub fn has_test_hooks() -> bool {
    if cfg!(debug_assertions) {
        return true;
    }
    skip_unless_allowed(
        "MQBLK_TEST_ALLOW_RELEASE_BUILD",
        "the daemon's test hooks (MQBLK_TEST_ONLY_*) are in debug builds only",
    );
    false
}
