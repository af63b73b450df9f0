//! The switchable mechanisms of the request path, set per export.

use serde::Serialize;

/// Polling mode of the I/O threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PollMode {
    /// Never poll: sleep on the kick eventfd after each batch.
    Off,
    /// Always poll for the full maximum window before sleeping.
    On,
    /// Adapt the window between 0 and the maximum.
    Adaptive,
}

/// How an export's I/O threads run their request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Tuning {
    /// Polling mode.
    pub poll: PollMode,
    /// Longest poll window, microseconds.
    pub poll_max_us: u32,
    /// Longest a poll goes on past its window while requests are at the engine, waiting for
    /// their completions, microseconds (0: never; `io::policy::engine_wait`).
    pub poll_engine_us: u32,
    /// Longest wait to grow a batch under heavy load, microseconds (0: never wait).
    pub batch_wait_us: u32,
    /// Merge adjacent requests into one host I/O.
    pub merge: bool,
    /// Register the engine's file with each I/O thread's ring (IOSQE_FIXED_FILE): no
    /// reference count on the shared `struct file` per I/O.
    pub fixed_files: bool,
    /// Register guest memory with each ring as fixed buffers: single-segment reads and writes
    /// use READ_FIXED/WRITE_FIXED and skip pinning pages per I/O. Pins all guest memory.
    pub fixed_buffers: bool,
    /// A kernel submission-queue polling thread per ring (IORING_SETUP_SQPOLL), idle after
    /// this many milliseconds (0: off).
    pub sqpoll_idle_ms: u32,
    /// Set up rings with COOP_TASKRUN (completions never interrupt the I/O thread).
    pub coop_taskrun: bool,
    /// Submit a batch's first I/Os before the rest is parsed while the device holds fewer
    /// (`io::policy::submit`), instead of the whole batch with one syscall.
    pub submit_early: bool,
    /// Notify the guest at a batch's first used entry while the I/O thread has its CPU to
    /// itself (`io::policy::notify`), instead of only after the last.
    pub notify_early: bool,
}

impl Default for Tuning {
    /// The defaults, and why, are measured in docs/PERFORMANCE.md (sections 5b, 5c and 5e2).
    fn default() -> Self {
        Tuning {
            poll: PollMode::Adaptive,
            poll_max_us: 32,
            poll_engine_us: 200,
            batch_wait_us: 0,
            merge: true,
            fixed_files: true,
            fixed_buffers: false,
            sqpoll_idle_ms: 0,
            coop_taskrun: true,
            submit_early: true,
            notify_early: true,
        }
    }
}
