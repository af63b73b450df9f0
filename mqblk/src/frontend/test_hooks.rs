//! What a test can make the vhost-user session do that no frontend makes it do on purpose
//! (debug builds only: a release build ignores the variable).
//!
//! **A panic** while a message is handled: the stand-in for a bug of mqblk's, or of the vhost
//! crate's, that some message reaches. Set to a queue index, the session panics the first time
//! it starts that queue (at a SET_VRING_ENABLE or SET_VRING_KICK), just after handing the
//! queue to its I/O thread, so that `tests/hostile_messages.rs` can check what contains the
//! panic: the listener closes that connection and resets its session as for any disconnect
//! (`daemon/listener.rs`), and the export and the daemon serve on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::test_hooks::debug_only;

/// The panic's variable: a queue index.
pub const PANIC_AFTER_START_ENV: &str = "MQBLK_TEST_ONLY_PANIC_AFTER_START";

/// Panics, once per process, if the panic is set for `queue`, which has just started.
pub fn after_start(queue: usize) {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static DONE: AtomicBool = AtomicBool::new(false);
    let at = *AT.get_or_init(|| {
        let at = debug_only(PANIC_AFTER_START_ENV)?;
        tracing::warn!(
            "{PANIC_AFTER_START_ENV}={at}: the session panics the first time it starts \
             queue {at} (a test's fault)"
        );
        Some(at)
    });
    if at == Some(queue as u64) && !DONE.swap(true, Ordering::Relaxed) {
        panic!("{PANIC_AFTER_START_ENV}: a test's panic after queue {queue} started");
    }
}
