//! Plain bytes straight into the request parser as a descriptor list (see
//! `mqblk_fuzz::run_raw` for the format): cheap, finds arithmetic panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mqblk_fuzz::run_raw(data);
});
