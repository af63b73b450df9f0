//! Adaptive polling: how long a worker busy-polls its rings before it sleeps.
//!
//! While a worker polls, guest notifications stay suppressed and completions are reaped from
//! the io_uring completion queue without syscalls. The window adapts from what recent waits
//! found, in the manner of QEMU's `poll-grow`/`poll-shrink` and Direct-Virtio's history-based
//! sleep time:
//! - a poll that found work keeps the window;
//! - a poll that expired, followed by a sleep that was woken soon after (within the maximum
//!   window), means the window was too short: it grows (doubles, from a starting step);
//! - a poll that expired and a long sleep mean polling does not pay: the window shrinks
//!   (halves, and drops to zero below the starting step), so an idle worker burns no CPU.

/// Polling mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Never poll: sleep on the kick eventfd after each batch.
    Off,
    /// Always poll for the full maximum window before sleeping.
    On,
    /// Adapt the window between 0 and the maximum.
    Adaptive,
}

impl std::str::FromStr for PollMode {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "off" => Ok(PollMode::Off),
            "on" => Ok(PollMode::On),
            "adaptive" => Ok(PollMode::Adaptive),
            _ => Err(()),
        }
    }
}

/// The first non-zero window, in nanoseconds.
pub const GROW_START_NS: u64 = 4_000;

/// The adaptive poll window.
#[derive(Debug, Clone)]
pub struct PollPolicy {
    mode: PollMode,
    max_ns: u64,
    window_ns: u64,
}

impl PollPolicy {
    /// A policy with the given mode and maximum window (microseconds).
    pub fn new(mode: PollMode, max_us: u32) -> Self {
        let max_ns = u64::from(max_us) * 1000;
        let window_ns = match mode {
            PollMode::Off => 0,
            PollMode::On => max_ns,
            PollMode::Adaptive => 0,
        };
        PollPolicy {
            mode,
            max_ns,
            window_ns,
        }
    }

    /// How long to poll now, in nanoseconds.
    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The mode.
    pub fn mode(&self) -> PollMode {
        self.mode
    }

    /// A poll found work after `_polled_ns`: keep the window.
    pub fn on_poll_hit(&mut self, _polled_ns: u64) {}

    /// A poll window expired without work, and the worker then slept `slept_ns` before the
    /// next event. Adapts the window.
    pub fn on_sleep(&mut self, slept_ns: u64) {
        if self.mode != PollMode::Adaptive || self.max_ns == 0 {
            return;
        }
        if slept_ns <= self.max_ns {
            // The event came soon after we gave up: polling longer would have caught it.
            self.window_ns = if self.window_ns == 0 {
                GROW_START_NS.min(self.max_ns)
            } else {
                (self.window_ns * 2).min(self.max_ns)
            };
        } else {
            // A long idle period: polling only burns CPU.
            self.window_ns /= 2;
            if self.window_ns < GROW_START_NS {
                self.window_ns = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_polls_on_always_does() {
        let mut p = PollPolicy::new(PollMode::Off, 50);
        p.on_sleep(1_000);
        assert_eq!(p.window_ns(), 0);
        let mut p = PollPolicy::new(PollMode::On, 50);
        p.on_sleep(10_000_000);
        assert_eq!(p.window_ns(), 50_000);
    }

    #[test]
    fn grows_on_short_sleeps_up_to_max() {
        let mut p = PollPolicy::new(PollMode::Adaptive, 50);
        assert_eq!(p.window_ns(), 0);
        p.on_sleep(10_000);
        assert_eq!(p.window_ns(), GROW_START_NS);
        for _ in 0..10 {
            p.on_sleep(10_000);
        }
        assert_eq!(p.window_ns(), 50_000);
    }

    #[test]
    fn shrinks_to_zero_when_idle() {
        let mut p = PollPolicy::new(PollMode::Adaptive, 64);
        for _ in 0..10 {
            p.on_sleep(1_000);
        }
        assert_eq!(p.window_ns(), 64_000);
        let mut steps = 0;
        while p.window_ns() > 0 {
            p.on_sleep(1_000_000_000);
            steps += 1;
            assert!(steps < 20, "window never reaches zero");
        }
        assert!(steps >= 4);
    }

    #[test]
    fn parse_modes() {
        assert_eq!("adaptive".parse::<PollMode>(), Ok(PollMode::Adaptive));
        assert_eq!("on".parse::<PollMode>(), Ok(PollMode::On));
        assert_eq!("off".parse::<PollMode>(), Ok(PollMode::Off));
        assert!("sometimes".parse::<PollMode>().is_err());
    }
}
