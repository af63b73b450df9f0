//! A qcow2 image of arbitrary bytes opened as an export (see `mqblk_fuzz::qcow2_image`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mqblk_fuzz::qcow2_image::run(data);
});
