//! Shows why the `qcow2_image` harness waits again after `io_uring_enter`: `cargo run --example
//! interrupted_wait` (in fuzz/). It submits a 3 s timeout with `submit_and_wait(1)` and raises
//! SIGALRM after 1 s, as libFuzzer's timeout alarm does. The call returns the count it submitted,
//! `Ok(1)`, after 1 s, with no completion in the ring; it exits 1 if a completion was there.

use io_uring::{opcode, types, IoUring};

extern "C" fn on_alarm(_: libc::c_int) {}

fn main() {
    // SAFETY: a handler that does nothing, installed before any other thread exists; alarm(2)
    // takes an integer.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_alarm as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGALRM, &action, std::ptr::null_mut());
        libc::alarm(1);
    }
    let mut ring = IoUring::new(4).expect("io_uring_setup");
    let three_seconds = types::Timespec::new().sec(3);
    let entry = opcode::Timeout::new(&three_seconds).build();
    // SAFETY: the timespec outlives the wait below.
    unsafe { ring.submission().push(&entry) }.expect("a free entry");
    let started = std::time::Instant::now();
    let returned = ring.submit_and_wait(1);
    let completion = ring.completion().next().map(|c| c.result());
    println!(
        "submit_and_wait(1) returned {returned:?} after {:?}; completion: {completion:?}",
        started.elapsed()
    );
    std::process::exit(i32::from(completion.is_some()));
}
