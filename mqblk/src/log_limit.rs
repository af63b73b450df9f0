//! Rate-limited logging for what a guest controls: a hostile guest must not be able to flood
//! the log, and the lines it costs are counted so that nothing is hidden.

use std::time::Instant;

/// Allows a few log lines per second and counts the rest.
pub struct LogLimiter {
    window: Instant,
    used: u32,
    dropped: u64,
}

impl Default for LogLimiter {
    fn default() -> Self {
        Self::new()
    }
}

impl LogLimiter {
    /// Lines allowed per second.
    pub const PER_SEC: u32 = 10;

    /// A fresh limiter.
    pub fn new() -> Self {
        LogLimiter {
            window: Instant::now(),
            used: 0,
            dropped: 0,
        }
    }

    /// Lines dropped since the last allowed one.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// `Some(lines dropped since the last allowed one)` if this line may be logged.
    pub fn allow(&mut self) -> Option<u64> {
        if self.window.elapsed().as_secs() >= 1 {
            self.window = Instant::now();
            self.used = 0;
        }
        if self.used < Self::PER_SEC {
            self.used += 1;
            Some(std::mem::take(&mut self.dropped))
        } else {
            self.dropped += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_per_second_then_counted() {
        let mut r = LogLimiter::new();
        for _ in 0..LogLimiter::PER_SEC {
            assert_eq!(r.allow(), Some(0));
        }
        assert_eq!(r.allow(), None);
        assert_eq!(r.allow(), None);
        r.window -= std::time::Duration::from_secs(1);
        assert_eq!(
            r.allow(),
            Some(2),
            "the next allowed line reports what was dropped"
        );
    }
}
