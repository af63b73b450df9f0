//! Live migration, one session's side: the dirty log the frontend hands over (SET_LOG_BASE),
//! whether it logs (VHOST_F_LOG_ALL in SET_FEATURES, switched on and off on live rings), and
//! which used rings it logs where (VHOST_VRING_F_LOG and log_guest_addr in SET_VRING_ADDR).
//! Every change goes to the I/O threads and is in force there before the message is answered:
//! the frontend syncs or replaces the log only after its answer.
//!
//! Refused, with the message's log line (the frontend's migration then fails instead of
//! copying a guest that mqblk cannot log): a log that cannot be mapped safely (see
//! [`DirtyLog::map`]), a log smaller than guest memory, a used ring logged beyond the log.
//! Ignored with a log line: VHOST_F_LOG_ALL without a log (nothing is logged until one comes).

use std::sync::{Arc, OnceLock};

use super::device::Device;
use super::error::{Error, Result};
use crate::io::dirty_log::DirtyLog;
use crate::io::{self, used_ring_len, Command};
use crate::test_hooks::debug_only;

/// Set to 1 in the environment of a debug build, mqblk accepts and acknowledges dirty logging
/// but marks nothing: the migration tests use it to show that they catch a backend that does
/// not log. A release build ignores it, so that no environment can make a production daemon
/// lose migrated guests' data.
pub const TEST_SKIP_ENV: &str = "MQBLK_TEST_ONLY_SKIP_DIRTY_LOG";

fn test_skip() -> bool {
    static SKIP: OnceLock<bool> = OnceLock::new();
    *SKIP.get_or_init(|| {
        let skip = debug_only(TEST_SKIP_ENV) == Some(1);
        if skip {
            tracing::error!(
                "{TEST_SKIP_ENV}=1: dirty logging is acknowledged but nothing is marked; \
                 live-migrated guests will lose data"
            );
        }
        skip
    })
}

/// One session's dirty logging.
pub struct Migration {
    log: Option<Arc<DirtyLog>>,
    /// VHOST_F_LOG_ALL is acked.
    log_all: bool,
    /// By vring: log_guest_addr, for rings with VHOST_VRING_F_LOG.
    used: Vec<Option<u64>>,
}

impl Migration {
    /// No logging, for a device of `queues` vrings.
    pub fn new(queues: usize) -> Self {
        Migration {
            log: None,
            log_all: false,
            used: vec![None; queues],
        }
    }

    /// Whether the I/O threads mark what they write now.
    pub fn logging(&self) -> bool {
        self.log_all && self.log.is_some() && !test_skip()
    }

    /// A new log (SET_LOG_BASE) for guest memory that ends at `mem_end`, with vrings of
    /// `ring_sizes` entries: refused if it does not cover the memory or a logged used ring.
    pub fn set_log(&mut self, log: DirtyLog, mem_end: u64, ring_sizes: &[u16]) -> Result<()> {
        if !log.fits(0, mem_end) {
            return Err(Error::LogTooSmall {
                covers: log.covers(),
                needs: mem_end,
            });
        }
        for (index, (&at, &size)) in self.used.iter().zip(ring_sizes).enumerate() {
            if let Some(addr) = at {
                check_used_log(&log, index, addr, size)?;
            }
        }
        tracing::info!(
            bytes = log.len(),
            covers = log.covers(),
            "dirty log set up for live migration"
        );
        self.log = Some(Arc::new(log));
        Ok(())
    }

    /// VHOST_F_LOG_ALL acked (true) or not; true when that changed.
    pub fn set_log_all(&mut self, on: bool) -> bool {
        if on == self.log_all {
            return false;
        }
        self.log_all = on;
        if on && self.log.is_none() {
            tracing::warn!(
                "VHOST_F_LOG_ALL acked without a log (SET_LOG_BASE): nothing is logged until one comes"
            );
        }
        tracing::info!(on, "dirty logging (VHOST_F_LOG_ALL)");
        true
    }

    /// SET_VRING_ADDR of vring `index` (of `size` entries): its used ring is logged at `addr`
    /// (VHOST_VRING_F_LOG), or not (`None`); true when that changed. Refused when the ring
    /// lies beyond the log.
    pub fn set_used_log(&mut self, index: usize, addr: Option<u64>, size: u16) -> Result<bool> {
        if let (Some(a), Some(log)) = (addr, self.log.as_deref()) {
            check_used_log(log, index, a, size)?;
        }
        let changed = self.used[index] != addr;
        self.used[index] = addr;
        Ok(changed)
    }

    /// Hands the threads of `device` what they mark now, and waits until each has it.
    pub fn apply(&self, device: &Device) {
        let log = self.log.clone().filter(|_| self.logging());
        let cfg = device.config();
        let mut used: Vec<Vec<Option<u64>>> = vec![Vec::new(); device.threads().len()];
        for (q, &addr) in self.used.iter().enumerate() {
            let (t, local) = (cfg.thread_of_queue(q), device.thread_of(q).1);
            let v = &mut used[t];
            if v.len() <= local {
                v.resize(local + 1, None);
            }
            v[local] = addr;
        }
        io::send_all_and_wait(device.threads(), |t, reply| Command::SetDirtyLog {
            log: log.clone(),
            used: std::mem::take(&mut used[t]),
            reply,
        });
    }
}

/// Refuses a used ring of vring `index` (`size` entries) logged at `addr` beyond `log`.
fn check_used_log(log: &DirtyLog, index: usize, addr: u64, size: u16) -> Result<()> {
    let len = used_ring_len(size);
    if log.fits(addr, len) {
        Ok(())
    } else {
        Err(Error::UsedLogOutside {
            index,
            addr,
            len,
            covers: log.covers(),
        })
    }
}
