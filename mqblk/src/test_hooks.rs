//! Reading the `MQBLK_TEST_ONLY_*` variables through which tests make a debug build do what no
//! guest, frontend or image makes it do on purpose (a panic, a delay, a skipped duty). A release
//! build reads none of them, so that no environment can change a production daemon.

/// The number in `var`, in a debug build; None in a release build, or where `var` is unset or
/// not a number.
pub fn debug_only(var: &str) -> Option<u64> {
    if !cfg!(debug_assertions) {
        return None;
    }
    std::env::var(var).ok()?.parse().ok()
}
