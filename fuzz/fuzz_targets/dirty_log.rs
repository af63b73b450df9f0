//! Structure-aware: the live-migration dirty log mapped from a hostile frontend's memfd (any
//! seals, offset and size) and marked with a hostile guest's ranges, checked byte for byte
//! against a plain bitmap model. See `mqblk_fuzz::dirty_log` for what is built and asserted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqblk_fuzz::dirty_log::{run_dirty_log, LogInput};

fuzz_target!(|input: LogInput| {
    run_dirty_log(&input);
});
