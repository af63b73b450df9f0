//! mqblk under systemd, with systemd's side done by hand (support::systemd): READY=1 only once
//! every export listens, STOPPING=1 at drain, WATCHDOG=1 when the unit asks; exports serving
//! listening sockets handed over by socket activation (`LISTEN_FDS`, named by export id) or
//! with `fd=N`, left in place at exit so that the next instance serves them.

mod support;

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mqblk_client::Client;
use support::daemon::*;
use support::proc::Proc;
use support::systemd::{activated_mqblk, pass_fds, NotifySocket};
use support::wait::wait_until;

/// `mqblk serve` with `args`, reporting to `notify`, and none of systemd's other variables
/// that the test's own environment might carry.
fn mqblk_notifying(notify: &NotifySocket, args: &[String]) -> Command {
    let mut cmd = Command::new(mqblk_bin());
    cmd.arg("serve").args(args);
    systemd_env(&mut cmd, notify);
    cmd
}

fn systemd_env(cmd: &mut Command, notify: &NotifySocket) {
    cmd.env("NOTIFY_SOCKET", &notify.path);
    for v in ["WATCHDOG_USEC", "WATCHDOG_PID"] {
        cmd.env_remove(v);
    }
}

/// Waits up to `timeout` for the daemon to exit; its status.
fn wait_exit(d: &mut Daemon, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = d.has_exited() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "daemon still running after {timeout:?}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn ready_comes_only_once_every_export_listens_and_stopping_at_drain() {
    let dir = TestDir::new();
    let mut notify = NotifySocket::bind(&dir.join("notify.sock"));
    let socks: Vec<PathBuf> = (0..4).map(|i| dir.join(&format!("e{i}.sock"))).collect();
    let mut args = Vec::new();
    for s in &socks {
        args.extend(export_arg(format!(
            "socket={},engine=null,size=16M,queues=4",
            s.display()
        )));
    }
    let d = Daemon::spawn(&dir, mqblk_notifying(&notify, &args), &[]);
    assert!(
        notify.wait_for("READY=1", STARTUP_TIMEOUT),
        "no READY=1; got {:?}\n{}",
        notify.lines,
        d.log()
    );
    // Checked at once: READY=1 must not come before the last socket listens.
    for s in &socks {
        assert!(s.exists(), "READY=1 before {} existed", s.display());
        assert!(is_listening(s), "READY=1 before {} listened", s.display());
    }
    assert!(
        notify.lines.iter().any(|l| l.starts_with("STATUS=")),
        "{:?}",
        notify.lines
    );
    notify.drain(Duration::from_millis(300));
    assert_eq!(notify.count("READY=1"), 1, "{:?}", notify.lines);
    assert_eq!(notify.count("WATCHDOG=1"), 0, "no watchdog was asked for");
    assert_eq!(notify.count("STOPPING=1"), 0, "{:?}", notify.lines);
    d.terminate();
    assert!(
        notify.wait_for("STOPPING=1", Duration::from_secs(5)),
        "no STOPPING=1 at drain; got {:?}",
        notify.lines
    );
}

#[test]
fn no_ready_when_an_export_cannot_start() {
    let dir = TestDir::new();
    let mut notify = NotifySocket::bind(&dir.join("notify.sock"));
    let mut args = Vec::new();
    args.extend(export_arg(format!(
        "socket={},engine=null,size=16M",
        dir.join("good.sock").display()
    )));
    args.extend(export_arg(format!(
        "socket={},path={}",
        dir.join("bad.sock").display(),
        dir.join("no/such/dir/disk.img").display()
    )));
    let mut d = Daemon::spawn(&dir, mqblk_notifying(&notify, &args), &[]);
    let status = wait_exit(&mut d, STARTUP_TIMEOUT);
    assert!(
        !status.success(),
        "started with a missing image\n{}",
        d.log()
    );
    notify.drain(Duration::from_millis(200));
    assert_eq!(notify.count("READY=1"), 0, "{:?}", notify.lines);
}

#[test]
fn watchdog_pings_at_half_the_units_interval() {
    let dir = TestDir::new();
    let mut notify = NotifySocket::bind(&dir.join("notify.sock"));
    let args = export_arg(format!(
        "socket={},engine=null,size=16M",
        dir.join("w.sock").display()
    ));
    let mut cmd = mqblk_notifying(&notify, &args);
    // WatchdogSec=200ms: a ping every 100 ms.
    cmd.env("WATCHDOG_USEC", "200000");
    let d = Daemon::spawn(&dir, cmd, &[]);
    assert!(notify.wait_for("READY=1", STARTUP_TIMEOUT), "{}", d.log());
    let start = notify.count("WATCHDOG=1");
    notify.drain(Duration::from_secs(1));
    let pings = notify.count("WATCHDOG=1") - start;
    assert!(
        (5..=15).contains(&pings),
        "{pings} WATCHDOG=1 in 1 s with WatchdogSec=200ms"
    );
    d.terminate();
}

/// The test plays systemd: it binds and keeps the socket, hands it to one daemon, then to the
/// next. A frontend that connects while no daemon runs is served by the next one: the socket
/// never disappears.
#[test]
fn a_socket_activated_export_serves_and_its_socket_outlives_a_restart() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", 16 * MIB, None);
    let path = dir.join("vm1.sock");
    let listener = UnixListener::bind(&path).expect("binding the activated socket");
    let stray = UnixListener::bind(dir.join("stray.sock")).unwrap();
    // socket= names the same path: under activation the daemon must not bind it (it is busy).
    let args = export_arg(format!(
        "id=vm1,socket={},path={},direct=off",
        path.display(),
        img.display()
    ));
    let start = |notify: &mut NotifySocket, dir: &TestDir| {
        let mut cmd = activated_mqblk(&[&listener, &stray], &["vm1", "stray"], &args);
        systemd_env(&mut cmd, notify);
        let d = Daemon::spawn(dir, cmd, &[]);
        assert!(
            notify.wait_for("READY=1", STARTUP_TIMEOUT),
            "no READY=1\n{}",
            d.log()
        );
        d
    };
    let mut notify = NotifySocket::bind(&dir.join("notify.sock"));
    let d = start(&mut notify, &dir);
    let log = d.log();
    assert!(
        log.contains("left unused") && log.contains("stray"),
        "no word on the unnamed descriptor:\n{log}"
    );
    let data = pattern(64 * 1024, 0, 11);
    {
        let mut c = Client::connect(&path, 1).expect("connecting to the activated socket");
        c.write(0, 0, &data).expect("write");
        assert_eq!(c.read_vec(0, 0, data.len()).expect("read"), data);
    }
    d.terminate();
    assert!(path.exists(), "the daemon removed a socket it did not bind");
    // The test holds the socket too, so this only says the daemon did not take it out of the
    // listening state; the frontend below, which connects while no daemon runs, is the real
    // check that the socket still takes connections.
    assert!(is_listening(&path));

    // A frontend connecting now waits in the socket's backlog for the next daemon.
    let (tx, rx) = mpsc::channel();
    let (p, want) = (path.clone(), data.clone());
    let waiting = std::thread::spawn(move || {
        let r = Client::connect(&p, 1)
            .map_err(|e| format!("{e:#}"))
            .and_then(|mut c| c.read_vec(0, 0, want.len()).map_err(|e| e.to_string()));
        tx.send(r.map(|got| got == want)).ok();
    });
    assert!(
        wait_until(Duration::from_secs(10), || connections_waiting(&path) == 1),
        "the frontend did not connect to the socket while no daemon ran"
    );
    let dir2 = TestDir::new();
    let d = start(&mut notify, &dir2);
    let verified = rx
        .recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("the waiting frontend was not served\n{}", d.log()));
    assert_eq!(verified, Ok(true), "data written through the first daemon");
    waiting.join().unwrap();
    // The restarted daemon accepts new frontends on the inherited socket (not only the one
    // that was already queued when it started): a real vhost-user session and I/O.
    {
        let mut c = Client::connect(&path, 1)
            .unwrap_or_else(|e| panic!("a new frontend after the restart: {e:#}\n{}", d.log()));
        let more = pattern(4096, 0, 12);
        c.write(0, 65536, &more).expect("write after the restart");
        assert_eq!(c.read_vec(0, 0, data.len()).expect("read"), data);
        assert_eq!(c.read_vec(0, 65536, more.len()).expect("read"), more);
    }
    d.terminate();
    assert!(path.exists() && is_listening(&path));
    // With no daemon running, a connection still lands in the socket's backlog: a real
    // connect, which a socket shut down or unlinked by the daemon would refuse.
    UnixStream::connect(&path).expect("connecting to the socket after the second daemon exited");
}

/// `fd=N`: the export serves the socket it inherits, reports the path it is bound to, and
/// leaves it in place at exit.
#[test]
fn fd_key_serves_an_inherited_listening_socket() {
    let dir = TestDir::new();
    let path = dir.join("inherited.sock");
    let stats = dir.join("stats.json");
    let listener = UnixListener::bind(&path).unwrap();
    let mut cmd = Command::new(mqblk_bin());
    cmd.args([
        "serve",
        "--export",
        "fd=3,engine=mem,size=16M",
        "--stats-file",
    ])
    .arg(&stats);
    pass_fds(&mut cmd, &[listener.as_raw_fd()]);
    let d = Daemon::spawn(&dir, cmd, &[]);
    // The daemon holds its own copy now.
    drop(listener);
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let export = loop {
        let text = std::fs::read_to_string(&stats).unwrap_or_default();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            break v["exports"][0].clone();
        }
        assert!(Instant::now() < deadline, "no stats file\n{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(export["id"], "fd-3", "{export}");
    assert_eq!(export["socket"], path.to_str().unwrap(), "{export}");
    let data = pattern(8192, 0, 3);
    let mut c = Client::connect(&path, 1).expect("connecting to the inherited socket");
    c.write(0, 4096, &data).expect("write");
    assert_eq!(c.read_vec(0, 4096, data.len()).expect("read"), data);
    drop(c);
    d.terminate();
    assert!(path.exists(), "the daemon removed a socket it did not bind");
}

/// Runs `mqblk serve --export fd=FD,...` with `fds` inherited from 3 on: it must fail, saying
/// what is wrong with the descriptor.
fn refused(fd: i32, fds: &[&dyn AsRawFd], why: &str) {
    let dir = TestDir::new();
    let log = dir.join("daemon.log");
    let mut cmd = Command::new(mqblk_bin());
    cmd.args(["serve", "--export", &format!("fd={fd},engine=null,size=1M")]);
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    pass_fds(&mut cmd, &raw);
    let mut p = Proc::spawn_logged(format!("mqblk fd={fd} ({why})"), &mut cmd, &log);
    let status = p
        .wait_timeout(STARTUP_TIMEOUT)
        .unwrap()
        .unwrap_or_else(|| panic!("mqblk kept running with fd={fd} ({why})"));
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "fd={fd} ({why}) was accepted:\n{out}");
    let want = format!("fd={fd}: {why}");
    assert!(out.contains(&want), "wanted {want:?} in:\n{out}");
}

#[test]
fn inherited_descriptors_that_are_not_listening_unix_stream_sockets_are_refused() {
    let dir = TestDir::new();
    refused(200, &[], "no such open file descriptor");
    let file = std::fs::File::create(dir.join("plain")).unwrap();
    refused(3, &[&file], "not a socket");
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    refused(3, &[&tcp], "not a unix socket");
    let dgram = UnixDatagram::bind(dir.join("dgram.sock")).unwrap();
    refused(3, &[&dgram], "not a stream socket");
    let (a, _b) = UnixStream::pair().unwrap();
    refused(3, &[&a], "not listening");
    // The descriptor named, not the first one handed over.
    refused(4, &[&dgram, &file], "not a socket");
}
