//! Connection lifecycle: one frontend per socket, and the daemon outlives its frontends.
mod common;

use std::time::{Duration, Instant};

use common::*;
use mqblk::client::Client;

/// While one frontend is connected, a second one is turned away at once (not left hanging in
/// the listen backlog), and the first keeps working.
#[test]
fn second_frontend_is_refused_while_one_is_connected() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", 4 << 20, None);
    let sock = dir.join("s.sock");
    let d = Daemon::start(&dir, &[Export::file(&sock, &img).queues(2)]);
    let mut first = Client::connect(&sock, 2).expect("first frontend");
    first.write(0, 0, &[7u8; 4096]).expect("first write");
    let t = Instant::now();
    let second = Client::connect(&sock, 1);
    assert!(
        second.is_err(),
        "a second frontend was accepted while the first is connected"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the second frontend waited {:?}",
        t.elapsed()
    );
    assert_eq!(
        first.read_vec(1, 0, 4096).expect("first read"),
        vec![7u8; 4096]
    );
    drop(first);
    // Once the first is gone, the next one is served.
    let mut third = Client::connect(&sock, 1).expect("frontend after the first left");
    assert_eq!(third.read_vec(0, 0, 4096).expect("read"), vec![7u8; 4096]);
    drop(third);
    assert!(
        d.log().contains("a second frontend connected"),
        "{}",
        d.log()
    );
    d.terminate();
}
