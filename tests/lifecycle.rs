//! Connection lifecycle: one frontend per socket, and the daemon outlives its frontends.
mod support;

use std::time::{Duration, Instant};

use mqblk_client::Client;
use support::daemon::*;
use support::proc::tasks;
use support::wait::wait_until;

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

/// The daemon's CPU time so far (utime + stime), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // The command name may contain spaces: fields count from the last ')'.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// A guest that stops doing I/O, but stays connected, costs the daemon next to no CPU, whatever
/// the polling mode: windows expire, the adaptive policy stops polling, and the I/O threads
/// sleep until the next kick.
#[test]
fn an_idle_connected_guest_costs_no_cpu() {
    for poll in ["adaptive", "on"] {
        let dir = TestDir::new();
        let img = dir.image("disk.img", 4 << 20, None);
        let sock = dir.join("s.sock");
        let d = Daemon::start(
            &dir,
            &[Export::file(&sock, &img)
                .queues(2)
                .set("poll", poll)
                .set("poll-max-us", "1000")],
        );
        let mut c = Client::connect(&sock, 2).expect("connect");
        // A busy spell on both queues (iodepth 1: every request a poll or a wake-up).
        for i in 0..2000u64 {
            c.read_vec((i % 2) as usize, (i % 1024) * 4096, 4096)
                .expect("read");
        }
        // Measured from when every I/O thread sleeps: its poll window after the last request
        // has run out.
        let io_threads_asleep = || {
            let io: Vec<_> = tasks(d.pid())
                .into_iter()
                .filter(|t| t.name.starts_with("mqblk-io"))
                .collect();
            !io.is_empty() && io.iter().all(|t| t.state == 'S')
        };
        assert!(
            wait_until(Duration::from_secs(10), io_threads_asleep),
            "poll={poll}: the I/O threads did not go to sleep with the guest idle: {:?}",
            tasks(d.pid())
        );
        let before = cpu_ticks(d.pid());
        std::thread::sleep(Duration::from_secs(2));
        let used = cpu_ticks(d.pid()) - before;
        // Clock ticks are 10 ms: allow 3 (1.5% of one CPU) for timer noise.
        assert!(
            used <= 3,
            "poll={poll}: the daemon used {used} ticks in 2 s with the guest idle"
        );
        // Still serving after the idle spell.
        c.read_vec(0, 0, 4096).expect("read after idling");
        drop(c);
        d.terminate();
    }
}
