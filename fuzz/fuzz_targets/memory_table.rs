//! Structure-aware: a hostile frontend's memory table messages (SET_MEM_TABLE, ADD_MEM_REG,
//! REM_MEM_REG) over memfds it truncates in between, and guest accesses anywhere. See
//! `mqblk_fuzz::memory_table` for what is built and asserted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqblk_fuzz::memory_table::{run_memory_table, TableInput};

fuzz_target!(|input: TableInput| {
    run_memory_table(&input);
});
