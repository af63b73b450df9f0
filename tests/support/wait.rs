//! Waiting for a condition with a deadline. The tests run on shared, busy machines, where a
//! fixed sleep is sometimes too short: a test waits for what it needs, and a deadline turns a
//! condition that never comes into a failure.

use std::time::{Duration, Instant};

/// How often [`wait_until`] looks.
const POLL: Duration = Duration::from_millis(10);

/// Polls `cond` until it holds (true) or `timeout` has passed (false). `cond` is asked once
/// more at the deadline, so a timeout of zero still asks once.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(POLL.min(deadline - now));
    }
}
