//! When staged I/O goes to the kernel: as early as the device can use it.
//!
//! The I/O thread parses a batch of requests and could submit them all with one
//! `io_uring_enter` at the end. One syscall per batch is cheapest, but it hands the device the
//! whole batch at once (one block-layer plug, one doorbell), and a device that was idle meanwhile
//! then completes the batch as a lump, the guest refills it as a lump, and the queue runs in
//! lockstep: full, then empty while the refill goes round the guest. (Measured on a virtio disk,
//! docs/PERFORMANCE.md section 7: native fio in lockstep loses 30% of its IOPS.)
//!
//! So the rule is slow start: submit what is queued as soon as it is at least as many I/Os as
//! the device already holds. An idle device gets the first request at once, then 1, 2, 4, 8...
//! more while the rest is parsed: a batch of 32 reaches it in about six syscalls instead of
//! one, each as soon as it is ready. A device that already holds many (it is saturated, the
//! case batching is for) gets large batches and one syscall each, as before.

/// Whether to submit now the `queued` I/Os not yet handed to the kernel, with `at_device` I/Os
/// already submitted and not completed.
pub fn submit_early(queued: u64, at_device: u64) -> bool {
    queued > 0 && queued >= at_device.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The syscalls a batch of `n` arriving at a device holding `busy` takes.
    fn enters(n: u64, busy: u64) -> u64 {
        let (mut queued, mut at_device, mut enters) = (0, busy, 0);
        for _ in 0..n {
            queued += 1;
            if submit_early(queued, at_device) {
                at_device += queued;
                queued = 0;
                enters += 1;
            }
        }
        enters + u64::from(queued > 0)
    }

    #[test]
    fn an_idle_device_gets_work_at_once_then_doubling_batches() {
        assert!(
            submit_early(1, 0),
            "the first request of an idle device goes at once"
        );
        assert!(!submit_early(0, 0));
        assert!(submit_early(2, 2) && !submit_early(1, 2));
        // 1, 1, 2, 4, 8, 16: six syscalls for 32.
        assert_eq!(enters(32, 0), 6);
    }

    #[test]
    fn a_busy_device_gets_whole_batches() {
        assert!(!submit_early(31, 32));
        assert_eq!(
            enters(8, 64),
            1,
            "submitted with the rest of the loop, once"
        );
        assert_eq!(enters(1, 0), 1);
    }
}
