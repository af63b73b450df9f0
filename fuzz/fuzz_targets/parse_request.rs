//! Structure-aware: a hostile guest's rings, descriptor and indirect tables and headers over a
//! guest memory map with holes, popped and parsed the way an mqblk I/O thread does it.
//! See `mqblk_fuzz::run_queue` for what is built and `mqblk_fuzz::check_outcome` for what is
//! asserted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqblk_fuzz::{run_queue, Input};

fuzz_target!(|input: Input| {
    run_queue(&input);
});
