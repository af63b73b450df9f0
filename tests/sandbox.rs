//! The daemon's sandbox, on by default (`--sandbox auto`): every thread filtered by seccomp,
//! with no_new_privs and no capability; I/O threads under a narrower filter of their own, which
//! a forbidden call ends the daemon on; exports the API adds only where the operator allowed
//! them; a real guest and the libblkio client served as usual. (The io_uring opcode allowlist is
//! proven by a unit test of `io::ring`, the Landlock rules by one of `sandbox::filesystem`, and
//! the rbd engine under the sandbox by `tests/rbd.rs`.)

mod support;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use mqblk_client::run;
use serde_json::json;
use support::api::daemon_with_api;
use support::daemon::*;
use support::proc::Proc;
use support::qemu::{
    log_section, mqblk_serve, read_lossy, report_line, result_failure, seed_from_env, GuestBoot,
    Qemu, WorkDir,
};
use support::sandbox::assert_confined;

/// Runs a verified workload of `ops` writes per job on every queue of `socket`.
fn verify(socket: &Path, queues: usize, seed: u64) {
    let w = verify_workload(socket, queues, queues, 64, seed);
    let r = run(&w).expect("verify workload");
    assert!(r.clean(), "workload not clean: {r}");
    assert_eq!(r.verified_bytes, queues as u64 * 64 * 4096, "{r}");
}

#[test]
fn every_thread_of_a_default_daemon_is_confined_and_serves() {
    let dir = TestDir::new();
    let image = dir.image("disk.img", 8 * MIB, Some(3));
    let sock = dir.join("vhost.sock");
    // No --sandbox: the default must confine. Guest memory registered as fixed buffers: the
    // registration is made on a confined ring and I/O thread, and must not be refused.
    let export = Export::file(&sock, &image)
        .queues(2)
        .set("fixed-buffers", "on");
    let (daemon, _api) = daemon_with_api(&dir, &[export]);
    verify(&sock, 2, 0x5a);
    assert!(
        !daemon.log().contains("cannot register guest memory"),
        "{}",
        daemon.log()
    );
    let threads = assert_confined(daemon.pid(), 2);
    // The main thread, the listener and the API thread at least beside the I/O threads.
    assert!(threads.len() >= 5, "{threads:#?}");
    assert!(
        daemon.log().contains("sandbox: confined"),
        "{}",
        daemon.log()
    );
    daemon.terminate();
}

#[test]
fn export_add_outside_the_allowed_directories_is_refused_naming_the_rule() {
    let dir = TestDir::new();
    let (daemon, mut api) = daemon_with_api(&dir, &[]);
    // A directory the daemon was not told about (daemon_with_api allows `dir` only).
    let elsewhere = TestDir::new();
    let image = elsewhere.image("disk.img", 4 * MIB, None);
    let (code, message) = api
        .call(
            "export_add",
            json!({"socket": dir.join("x.sock"), "path": image}),
        )
        .expect_err("an image outside --allow-dir must be refused");
    assert_eq!(code, -32004, "{message}");
    assert!(
        message.contains(&image.display().to_string())
            && message.contains("--allow-dir")
            && message.contains(&dir.path().display().to_string()),
        "the message names the path, the rule and what it allows now: {message}"
    );
    let socket = elsewhere.join("x.sock");
    let (_, message) = api
        .call(
            "export_add",
            json!({"socket": socket, "engine": "null", "size": "1M"}),
        )
        .expect_err("a socket outside --allow-dir must be refused");
    assert!(message.contains("socket directory"), "{message}");
    assert!(!socket.exists());
    // Inside it: served.
    let inside = dir.image("inside.img", 4 * MIB, None);
    let sock = dir.join("inside.sock");
    api.ok("export_add", json!({"socket": sock, "path": inside}));
    verify(&sock, 1, 0x77);
    daemon.terminate();
}

#[test]
fn a_forbidden_system_call_on_an_io_thread_stops_the_daemon_with_sigsys() {
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    let image = dir.image("disk.img", 4 * MIB, None);
    let (mut daemon, _api) = daemon_with_api(&dir, &[Export::file(&sock, &image).queues(2)]);
    verify(&sock, 2, 0x33);
    // I/O thread 1 binds a TCP socket, which no I/O thread needs. The daemon may die before it
    // answers: the request is sent, the answer not waited for.
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": "debug_inject_fault",
        "params": {"id": "vhost", "thread": 1, "fault": "forbidden-syscall"}});
    let mut api = UnixStream::connect(dir.join("api.sock")).expect("connecting to the API");
    writeln!(api, "{request}").expect("sending the request");
    let status = daemon
        .wait_exit(Duration::from_secs(10))
        .expect("the daemon must stop on a forbidden system call");
    assert_eq!(
        status.signal(),
        Some(libc::SIGSYS),
        "killed by SIGSYS, as SECCOMP_RET_KILL_PROCESS would: {status}\n{}",
        daemon.log()
    );
    let log = daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains("seccomp allowlist forbids"))
        .unwrap_or_else(|| panic!("no line names the forbidden call:\n{log}"));
    assert!(
        line.contains("thread mqblk-io1-vhost")
            && line.contains(&format!("system call {}", libc::SYS_socket)),
        "the line names the thread and the call: {line}"
    );
}

#[test]
fn a_guest_writes_and_verifies_its_disk_under_the_sandbox() {
    const QUEUES: usize = 2;
    let boot = GuestBoot::prepare("tests/guest/mkinitramfs.sh");
    let seed = seed_from_env();
    let dir = WorkDir::new("mqblk-sandbox.");
    write_image(&dir.image, 64 * MIB, None);
    let backend_log = dir.path.join("backend.log");
    let mut cmd = mqblk_serve(Path::new(env!("CARGO_BIN_EXE_mqblk")), &dir, QUEUES);
    let mut server = Proc::spawn_logged("mqblk".into(), &mut cmd, &backend_log);
    let fail = |what: String| -> ! {
        panic!(
            "{what}\n{}{}{}{}",
            log_section("guest console", &dir.console, 100),
            log_section("QEMU output", &dir.qemu_log, 50),
            log_section("backend log", &backend_log, 100),
            dir.keep_for(seed)
        )
    };
    if let Err(e) = server.wait_for_socket(&dir.socket, STARTUP_TIMEOUT, || true) {
        fail(e);
    }
    let append =
        format!("console=ttyS0 panic=-1 loglevel=4 mqblk.seed={seed} mqblk.expect_queues={QUEUES}");
    let q = Qemu {
        smp: 2,
        cpu: None,
        chardev_extra: String::new(),
        queues: QUEUES,
        append,
    };
    let mut qemu = boot.spawn_qemu(&dir, q);
    // Once the guest drives its disk, the daemon's every thread is confined.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !read_lossy(&dir.console).contains("MQBLK-GUEST: queues=") {
        if Instant::now() > deadline || qemu.try_wait().is_ok_and(|s| s.is_some()) {
            fail("the guest did not report its disk".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_confined(server.child.id(), QUEUES);
    let status = match qemu.wait_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Some(s)) => s,
        _ => {
            qemu.kill();
            fail("the guest did not power off in time".into());
        }
    };
    let console = read_lossy(&dir.console);
    if let Some(f) = result_failure(console.lines().filter_map(report_line)) {
        fail(f);
    }
    assert!(status.success(), "QEMU exited with {status}");
    let problems = server.terminate(SHUTDOWN_TIMEOUT);
    if !problems.is_empty() {
        fail(problems.join("; "));
    }
}

#[test]
fn strict_with_user_and_group_runs_unprivileged_and_serves() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TestDir::new();
    let image = dir.image("disk.img", 4 * MIB, None);
    // nobody must reach the directory (to bind the socket) and the image.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o666)).unwrap();
    let sock = dir.join("vhost.sock");
    // A qcow2 image too, which the default metadata-commit=auto serves with a journal.
    let qcow2 = dir.join("disk.qcow2");
    let qcow2_sock = dir.join("qcow2.sock");
    let exports = [
        Export::file(&sock, &image),
        Export::file(&qcow2_sock, &qcow2)
            .set("format", "qcow2")
            .set("size", &(4 * MIB).to_string()),
    ];
    let args = ["--sandbox", "strict", "--user", "65534", "--group", "65534"];
    let daemon = Daemon::start_args(&dir, &exports, &args);
    verify(&sock, 1, 0x99);
    verify(&qcow2_sock, 1, 0x9a);
    // In the journals' directory of the daemon's user, which the daemon made and gave to that
    // user before it gave up root.
    use std::os::unix::fs::MetadataExt;
    let name = mqblk::format::qcow2::journal_path(&qcow2).unwrap();
    let journals = mqblk::config::state_dir::qcow2_journals_of(65534);
    let journal = journals.join(name.file_name().unwrap());
    assert!(
        daemon
            .log()
            .contains("new clusters' mappings are journaled"),
        "{}",
        daemon.log()
    );
    for path in [&journals, &journal] {
        let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!((m.uid(), m.gid()), (65534, 65534), "{}", path.display());
    }
    assert_confined(daemon.pid(), 1);
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid())).unwrap();
    for key in ["Uid:", "Gid:"] {
        let ids: Vec<&str> = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .expect("an id line")
            .split_whitespace()
            .collect();
        assert_eq!(ids, ["65534"; 4], "{key} real, effective, saved, fs");
    }
    let groups = status.lines().find_map(|l| l.strip_prefix("Groups:"));
    assert_eq!(groups.map(str::trim), Some("65534"), "{status}");
    daemon.terminate();
}

#[test]
fn sandbox_off_leaves_the_daemon_unconfined() {
    let dir = TestDir::new();
    let image = dir.image("disk.img", 4 * MIB, None);
    let sock = dir.join("vhost.sock");
    let api = dir.join("api.sock");
    let args = ["--sandbox", "off", "--api-socket", api.to_str().unwrap()];
    let daemon = Daemon::start_args(&dir, &[Export::file(&sock, &image)], &args);
    verify(&sock, 1, 0x11);
    let threads = support::sandbox::threads(daemon.pid());
    assert!(threads.iter().all(|t| t.seccomp == 0), "{threads:#?}");
    // The call a confined I/O thread dies of is made, and the daemon goes on.
    let mut api = support::api::Api::connect(&api);
    api.ok(
        "debug_inject_fault",
        json!({"id": "vhost", "fault": "forbidden-syscall"}),
    );
    verify(&sock, 1, 0x12);
    daemon.terminate();
}

/// Where the locked-memory limit is finite and the daemon cannot lift it (no
/// CAP_SYS_RESOURCE, as in a container), the control threads keep CAP_IPC_LOCK permitted so
/// that each ring is made exempt from the limit. A qcow2 export's metadata worker registers a
/// region of 2 MiB (32 clusters of 64 KiB) with its ring: made on a control thread (every
/// export starts after confinement), it would count against the 1 MiB limit set here and be
/// refused. Made on the worker's own thread through the same exemption as an I/O thread's
/// ring, it is registered, and the worker then holds no capability.
#[test]
fn a_qcow2_export_added_under_a_memlock_limit_it_cannot_lift_registers_its_worker_region() {
    use rustix::process::{setrlimit, Resource, Rlimit};
    use rustix::thread::{
        capabilities, remove_capability_from_bounding_set, set_capabilities, CapabilitySet,
    };
    use std::os::unix::process::CommandExt;
    const LIMIT: u64 = 1 << 20;
    let dir = TestDir::new();
    let api_sock = dir.join("api.sock");
    let mut cmd = std::process::Command::new(mqblk_bin());
    cmd.arg("serve")
        .arg("--api-socket")
        .arg(&api_sock)
        .arg("--allow-dir")
        .arg(dir.path())
        .args(["--log-level", "info,mqblk::engine::qcow2=debug"]);
    // SAFETY: the closure runs in the child between fork and exec and makes only raw system
    // calls (rustix calls the kernel directly): async-signal-safe, touching no memory of the
    // parent's.
    unsafe {
        cmd.pre_exec(|| {
            let limit = Rlimit {
                current: Some(LIMIT),
                maximum: Some(LIMIT),
            };
            setrlimit(Resource::Memlock, limit)?;
            let lifting = CapabilitySet::SYS_RESOURCE;
            remove_capability_from_bounding_set(lifting)?;
            let mut sets = capabilities(None)?;
            sets.effective.remove(lifting);
            sets.permitted.remove(lifting);
            sets.inheritable.remove(lifting);
            set_capabilities(None, sets)?;
            Ok(())
        });
    }
    let daemon = Daemon::spawn(&dir, cmd, &[&api_sock]);
    let mut api = support::api::Api::connect(&api_sock);
    assert!(
        daemon.log().contains("control threads keep CAP_IPC_LOCK"),
        "the daemon must run as root with CAP_IPC_LOCK, and be unable to lift the limit:\n{}",
        daemon.log()
    );
    let sock = dir.join("qcow2.sock");
    api.ok(
        "export_add",
        json!({"socket": sock, "path": dir.join("disk.qcow2"), "format": "qcow2", "size": "16M"}),
    );
    // Writes into new clusters: copy-on-writes built in the worker's region.
    verify(&sock, 1, 0x3c);
    assert!(
        !daemon
            .log()
            .contains("copy-on-write buffers not registered"),
        "the worker's region counted against the limit:\n{}",
        daemon.log()
    );
    // Added after the sandbox closed the filesystem, it keeps a journal (the default
    // metadata-commit=auto) in the journals' directory the sandbox granted at startup.
    assert!(
        daemon
            .log()
            .contains("new clusters' mappings are journaled"),
        "{}",
        daemon.log()
    );
    let threads = assert_confined(daemon.pid(), 1);
    let worker = threads.iter().find(|t| t.name.starts_with("qcow2"));
    let worker = worker.unwrap_or_else(|| panic!("no metadata worker thread: {threads:#?}"));
    assert_eq!(
        worker.cap_prm, 0,
        "the worker kept a capability: {worker:?}"
    );
    daemon.terminate();
}
