//! A delay a crash test can put between a new cluster's mapping and its data write (debug
//! builds only). [`early_maps`](super::early_maps) keeps such a mapping out of the image file
//! until the data is written; the window lasts one data write, too short for a SIGKILL to
//! land in it on purpose. Set to N in the environment of a debug build, the copy-on-write
//! waits N ms there, on its worker's ring (other jobs and group commits go on), so that
//! `tests/qcow2.rs` can kill mqblk inside it and check what reached the file. A release build
//! ignores it.

use std::sync::OnceLock;
use std::time::Duration;

use super::uring_io;

/// The variable, in milliseconds.
pub const EARLY_DATA_DELAY_ENV: &str = "MQBLK_TEST_ONLY_EARLY_DATA_DELAY_MS";

/// Waits the delay, if one is set.
pub async fn before_early_data() {
    if let Some(d) = delay() {
        uring_io::sleep(d).await;
    }
}

fn delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        if !cfg!(debug_assertions) {
            return None;
        }
        let ms: u64 = std::env::var(EARLY_DATA_DELAY_ENV).ok()?.parse().ok()?;
        tracing::warn!(
            "{EARLY_DATA_DELAY_ENV}={ms}: each new cluster's data is written {ms} ms after its \
             mapping (a test's delay)"
        );
        Some(Duration::from_millis(ms))
    })
}
