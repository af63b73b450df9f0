//! What a test can make the metadata worker do that no image or guest makes it do on purpose
//! (debug builds only: a release build ignores these variables).
//!
//! - **A delay** between a new cluster's mapping and its data write.
//!   [`early_maps`](super::early_maps) keeps such a mapping out of the image file until the
//!   data is written; the window lasts one data write, too short for a SIGKILL to land in it on
//!   purpose. Set to N, the copy-on-write waits N ms there, on its worker's ring (other jobs and
//!   group commits go on), so that `tests/qcow2.rs` can kill mqblk inside it and check what
//!   reached the file.
//! - **A delay** between a flush's sync and the clearing of the image's dirty mark
//!   (`metadata-commit=flush`, [`dirty_mark`](super::dirty_mark)): set to N, the flush waits
//!   N ms there, on its worker's ring, so that a test can complete a write into a new cluster
//!   inside the window (its mapping after the flush's write-back) and check that the mark stays.
//! - **A delay** before a copy-on-write copies the guest's data into the new cluster: the
//!   worker's one access to guest memory in user space that the I/O thread did not make just
//!   before. Set to N, the copy waits N ms, so that `tests/shm_truncation.rs` can truncate the
//!   frontend's memory in between and check that the worker's fault is contained too.
//! - **A panic** of the worker at a guest write: the stand-in for a bug of imago's or ours that
//!   a crafted image or request reaches. Set to a byte offset, a metadata-path write starting
//!   there panics the worker, so that `tests/qcow2.rs` can check what contains it
//!   ([`metadata`](super::metadata): the image is given up, every request the worker held or
//!   is sent fails, the daemon serves on).
//! - **An abort** of the daemon in a journal's replay
//!   ([`journal_replay`](super::journal_replay)): set to N, the process aborts once the replay
//!   has written N clusters through imago, so that `tests/qcow2_journal.rs` can check that a
//!   replay cut short runs again from what it staged.

use std::sync::OnceLock;
use std::time::Duration;

use super::uring_io;
use crate::test_hooks::debug_only;

/// The delay's variable, in milliseconds.
pub const EARLY_DATA_DELAY_ENV: &str = "MQBLK_TEST_ONLY_EARLY_DATA_DELAY_MS";

/// The dirty mark's delay's variable, in milliseconds.
pub const CLEAR_DELAY_ENV: &str = "MQBLK_TEST_ONLY_DIRTY_CLEAR_DELAY_MS";

/// The copy's delay's variable, in milliseconds.
pub const COPY_DELAY_ENV: &str = "MQBLK_TEST_ONLY_COW_COPY_DELAY_MS";

/// The panic's variable: a guest byte offset.
pub const WORKER_PANIC_AT_ENV: &str = "MQBLK_TEST_ONLY_WORKER_PANIC_AT";

/// Before a new cluster's data is written after its early mapping.
pub static BEFORE_EARLY_DATA: Delay = Delay::new(
    EARLY_DATA_DELAY_ENV,
    "each new cluster's data is written",
    "after its mapping",
);

/// Before a flush clears the dirty mark, after its sync.
pub static BEFORE_CLEARING_THE_DIRTY_MARK: Delay = Delay::new(
    CLEAR_DELAY_ENV,
    "each flush clears the dirty mark",
    "after its sync",
);

/// Before a copy-on-write copies the guest's data into the cluster it read.
pub static BEFORE_COPYING_GUEST_DATA: Delay = Delay::new(
    COPY_DELAY_ENV,
    "each copy-on-write copies the guest's data",
    "after reading the cluster",
);

/// A delay a test sets in milliseconds through `env`: read once, said once (`what`, the
/// milliseconds, then `when`), and waited on the worker's ring.
pub struct Delay {
    env: &'static str,
    what: &'static str,
    when: &'static str,
    ms: OnceLock<Option<Duration>>,
}

impl Delay {
    const fn new(env: &'static str, what: &'static str, when: &'static str) -> Self {
        Delay {
            env,
            what,
            when,
            ms: OnceLock::new(),
        }
    }

    /// Waits the delay, if one is set.
    pub async fn wait(&self) {
        let delay = *self.ms.get_or_init(|| {
            let ms = debug_only(self.env)?;
            let (env, what, when) = (self.env, self.what, self.when);
            tracing::warn!("{env}={ms}: {what} {ms} ms {when} (a test's delay)");
            Some(Duration::from_millis(ms))
        });
        if let Some(d) = delay {
            uring_io::sleep(d).await;
        }
    }
}

/// The replay's abort's variable: clusters written before it.
pub const REPLAY_ABORT_AFTER_ENV: &str = "MQBLK_TEST_ONLY_REPLAY_ABORT_AFTER";

/// Aborts the process if the replay's abort is set for `written` clusters.
pub fn replay_wrote(written: u64) {
    static AFTER: OnceLock<Option<u64>> = OnceLock::new();
    let after = *AFTER.get_or_init(|| debug_only(REPLAY_ABORT_AFTER_ENV));
    if after == Some(written) {
        tracing::warn!("{REPLAY_ABORT_AFTER_ENV}={written}: the replay aborts (a test's fault)");
        std::process::abort();
    }
}

/// Panics if the panic is set for a write at `offset`.
pub fn before_write(offset: u64) {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    let at = *AT.get_or_init(|| {
        let at = debug_only(WORKER_PANIC_AT_ENV)?;
        tracing::warn!(
            "{WORKER_PANIC_AT_ENV}={at}: a metadata-path write at that offset panics the worker \
             (a test's fault)"
        );
        Some(at)
    });
    if at == Some(offset) {
        panic!("{WORKER_PANIC_AT_ENV}: a test's panic at a write at {offset}");
    }
}
