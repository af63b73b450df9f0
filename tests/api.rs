//! The management API against the real daemon: adding, removing and resizing exports while
//! others serve, what it refuses, who may talk to it, and save_config.
mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use mqblk_client::{check_pattern, fill_pattern, Client, Pattern, Workload};
use serde_json::{json, Value};
use support::api::{daemon_with_api as daemon, Api};
use support::daemon::{file_len, mqblk_bin, Daemon, Export, TestDir, MIB};
use support::wait::wait_until;

fn ids(api: &mut Api) -> Vec<String> {
    api.ok("export_list", json!({}))
        .as_array()
        .expect("a list")
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect()
}

/// Writes a seeded pattern over `len` bytes from `offset` and reads it back.
fn write_and_verify(c: &mut Client, offset: u64, len: usize, seed: u64) {
    let mut data = vec![0u8; len];
    fill_pattern(&mut data, offset, seed);
    c.write(0, offset, &data).expect("write");
    let back = c.read_vec(0, offset, len).expect("read back");
    assert_eq!(
        check_pattern(&back, offset, seed),
        None,
        "data at {offset} read back wrong"
    );
}

/// The test that holds a running export to no stall over 100 ms runs alone: the other tests of
/// this file, run in parallel threads on a 2-core machine, took the CPU from it for up to
/// 150 ms. The others share the lock and run together.
static ALONE: RwLock<()> = RwLock::new(());

fn alone() -> RwLockWriteGuard<'static, ()> {
    ALONE.write().unwrap_or_else(|e| e.into_inner())
}

fn together() -> RwLockReadGuard<'static, ()> {
    ALONE.read().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn exports_are_added_and_removed_while_another_serves() {
    let _guard = alone();
    let dir = TestDir::new();
    // The running export's image is on a tmpfs, so that a stall measured below is the
    // daemon's: on the test directory's ext4, creating, writing back and deleting the other
    // export's image starts journal commits that the running export's O_DIRECT writes wait
    // for (their mtime updates), which once made a 154 ms gap there.
    let busy_dir = TestDir::on_tmpfs();
    let busy_img = busy_dir.image("busy.img", 64 * MIB, None);
    let busy = dir.join("busy.sock");
    // direct=off: tmpfs takes O_DIRECT only from Linux 6.6, and has no other cache to skip.
    let busy_export = Export::file(&busy, &busy_img).queues(2).direct(false);
    let (mut d, mut api) = daemon(&dir, &[busy_export]);

    // The running export serves random writes for the whole test, at a depth that leaves the
    // two CPUs room for the daemon's control plane and the test (the bound below is on
    // stalls, not on a CPU-starved client's own scheduling).
    let workload = {
        let mut w = Workload::new(&busy);
        w.num_queues = 2;
        w.jobs = 2;
        w.iodepth = 4;
        w.pattern = Pattern::RandWrite;
        w.runtime = Some(Duration::from_secs(4));
        std::thread::spawn(move || mqblk_client::run(&w))
    };
    let serving = wait_until(Duration::from_secs(10), || {
        api.ok("export_get", json!({"id": "busy"}))["status"]["counters"]["requests"]
            .as_u64()
            .is_some_and(|n| n > 0)
    });
    assert!(serving, "the running export's workload never got going");

    let new_img = dir.image("new.img", 16 * MIB, None);
    let new_sock = dir.join("new.sock");
    let added = api.ok(
        "export_add",
        json!({"id": "hot", "socket": new_sock, "path": new_img, "queues": 2, "direct": false}),
    );
    assert_eq!(
        (added["id"].as_str(), added["capacity"].as_u64()),
        (Some("hot"), Some(16 * MIB))
    );
    assert_eq!(ids(&mut api), vec!["busy", "hot"]);

    let mut c = Client::connect(&new_sock, 2).expect("connect to the added export");
    assert_eq!(c.capacity(), 16 * MIB);
    write_and_verify(&mut c, 4 * MIB, 256 * 1024, 11);
    let got = api.ok("export_get", json!({"id": "hot"}));
    assert_eq!(got["status"]["connected"], true, "{got}");
    assert_eq!(got["config"]["queues"], "2", "{got}");

    // safe refuses while the frontend is there; hard drains and disconnects it.
    let e = api.call("export_del", json!({"id": "hot"})).unwrap_err();
    assert_eq!(e.0, -32003, "{e:?}");
    assert!(e.1.contains("frontend connected"), "{e:?}");
    assert!(new_sock.exists());
    api.ok("export_del", json!({"id": "hot", "mode": "hard"}));
    assert!(!new_sock.exists(), "the socket file is removed");
    assert!(
        c.read_vec(0, 0, 4096).is_err(),
        "the removed export's frontend was disconnected"
    );
    drop(c);
    let e = api.call("export_del", json!({"id": "hot"})).unwrap_err();
    assert_eq!(e.0, -32001, "a second delete: {e:?}");
    assert_eq!(ids(&mut api), vec!["busy"]);

    // The same id and socket can be used again, and a safe delete of an idle export works.
    api.ok(
        "export_add",
        json!({"id": "hot", "socket": new_sock, "engine": "null", "size": "1M"}),
    );
    api.ok("export_del", json!({"id": "hot", "mode": "safe"}));

    let r = workload.join().unwrap().expect("workload");
    assert!(r.clean(), "the running export saw errors: {r}");
    let max = r.latency.max();
    assert!(
        max < Duration::from_millis(100),
        "the running export stalled for {max:?} while exports were added and removed"
    );
    assert!(d.stop().success());
}

#[test]
fn resize_grows_and_shrinks_and_nothing_reaches_past_the_end() {
    let _guard = together();
    let dir = TestDir::new();
    let img = dir.image("disk.img", 8 * MIB, None);
    let sock = dir.join("disk.sock");
    let (mut d, mut api) = daemon(&dir, &[Export::file(&sock, &img).direct(false)]);

    let r = api.ok("export_resize", json!({"id": "disk", "size": "16M"}));
    assert_eq!(r["capacity"], 16 * MIB);
    assert_eq!(file_len(&img), 16 * MIB);
    let mut c = Client::connect(&sock, 1).expect("connect");
    assert_eq!(c.capacity(), 16 * MIB, "a new frontend sees the new size");
    write_and_verify(&mut c, 15 * MIB, 1024 * 1024, 3);

    // Shrink under a frontend that still believes the old size.
    let r = api.ok("export_resize", json!({"id": "disk", "size": 4 * MIB}));
    assert_eq!(r["capacity"], 4 * MIB);
    assert_eq!(file_len(&img), 4 * MIB);
    let e = c.read_vec(0, 8 * MIB, 4096).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO), "a read past the new end: {e}");
    let e = c.write(0, 12 * MIB, &[7u8; 4096]).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO), "a write past the new end: {e}");
    assert_eq!(file_len(&img), 4 * MIB, "nothing wrote past the new end");
    write_and_verify(&mut c, 0, 64 * 1024, 5);

    // Without a size, the export follows its file.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(6 * MIB)
        .unwrap();
    let r = api.ok("export_resize", json!({"id": "disk"}));
    assert_eq!(r["capacity"], 6 * MIB);
    let e = api
        .call("export_resize", json!({"id": "disk", "size": 1000}))
        .unwrap_err();
    assert!(e.1.contains("'size' is 1000"), "{e:?}");
    let e = api
        .call("export_resize", json!({"id": "nope", "size": "1M"}))
        .unwrap_err();
    assert_eq!(e.0, -32001);
    drop(c);
    assert!(d.stop().success());
}

#[test]
fn bad_requests_get_errors_and_the_daemon_keeps_serving() {
    let _guard = together();
    let dir = TestDir::new();
    let img = dir.image("keep.img", 4 * MIB, None);
    let keep = dir.join("keep.sock");
    let (mut d, mut api) = daemon(&dir, &[Export::file(&keep, &img).direct(false)]);
    let mut c = Client::connect(&keep, 1).expect("connect");

    let code = |v: &Value| {
        v["error"]["code"]
            .as_i64()
            .unwrap_or_else(|| panic!("no error: {v}"))
    };
    let msg = |v: &Value| v["error"]["message"].as_str().unwrap_or("").to_string();

    let r = api.raw(br#"{"jsonrpc":"2.0","id":1,"method":"export_frobnicate"}"#);
    assert_eq!(code(&r), -32601);
    assert!(msg(&r).contains("export_frobnicate"), "{r}");
    let r = api.raw(b"{\"jsonrpc\": \"2.0\", \"id\": 2, \"method\": ");
    assert_eq!(code(&r), -32700, "{r}");
    let r = api.raw(br#"{"jsonrpc":"2.0","id":3,"method":"export_get","params":{"id":7}}"#);
    assert_eq!(code(&r), -32602);
    assert!(msg(&r).contains("'id' must be a string"), "{r}");
    let e = api
        .call(
            "export_add",
            json!({"socket": dir.join("x.sock"), "engine": "null", "size": "1M", "queues": "lots"}),
        )
        .unwrap_err();
    assert!(
        e.0 == -32602 && e.1.contains("invalid queues=lots"),
        "{e:?}"
    );
    let e = api
        .call(
            "export_add",
            json!({"id": "keep", "socket": dir.join("y.sock"), "engine": "null", "size": "1M"}),
        )
        .unwrap_err();
    assert!(
        e.0 == -32002 && e.1.contains("id=keep"),
        "duplicate id: {e:?}"
    );
    let e = api
        .call(
            "export_add",
            json!({"id": "other", "socket": keep, "engine": "null", "size": "1M"}),
        )
        .unwrap_err();
    assert!(
        e.0 == -32002 && e.1.contains("socket="),
        "duplicate socket: {e:?}"
    );
    let e = api
        .call(
            "export_add",
            json!({"socket": dir.join("w.sock"), "engine": "null", "size": "1M", "fd": 0}),
        )
        .unwrap_err();
    assert!(
        e.0 == -32602 && e.1.contains("'fd' is accepted only at startup"),
        "an inherited descriptor through the API: {e:?}"
    );
    let missing = dir.join("missing/disk.img");
    let e = api
        .call(
            "export_add",
            json!({"socket": dir.join("z.sock"), "path": missing}),
        )
        .unwrap_err();
    assert!(
        e.0 == -32004 && e.1.contains("missing/disk.img"),
        "unopenable path: {e:?}"
    );
    assert!(
        !dir.join("z.sock").exists(),
        "a failed add leaves no socket behind"
    );

    // A megabyte of garbage on one line, then a good request on the same connection.
    let garbage: Vec<u8> = (0..1 << 20).map(|i| b"#%&x\xff"[i % 5]).collect();
    let r = api.raw(&garbage);
    assert_eq!(code(&r), -32700);
    assert!(msg(&r).contains("longer than"), "{r}");
    assert_eq!(api.ok("version", json!({}))["name"], "mqblk");

    // Everything above left the daemon and its export serving.
    assert_eq!(ids(&mut api), vec!["keep"]);
    write_and_verify(&mut c, 0, 65536, 9);
    drop(c);
    assert!(d.stop().success());
}

#[test]
fn the_api_socket_is_private() {
    let _guard = together();
    let dir = TestDir::new();
    let (mut d, mut api) = daemon(&dir, &[]);
    let path = dir.join("api.sock");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the API socket is created 0600");
    assert_eq!(
        ids(&mut api),
        Vec::<String>::new(),
        "serve starts with no export"
    );

    // Another user: refused by the file's mode, and, with the mode opened up, by the daemon's
    // check of the peer's credentials.
    let as_nobody = |p: &Path| {
        use std::os::unix::process::CommandExt;
        Command::new(mqblk_bin())
            .args(["ctl", "--api-socket"])
            .arg(p)
            .arg("version")
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run mqblk ctl as nobody")
    };
    // nobody must be able to reach the socket's directory for the second check.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = as_nobody(&path);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ermission denied"),
        "{out:?}"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = as_nobody(&path);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("uid 65534 may not manage"), "{err}");
    assert_eq!(
        api.ok("version", json!({}))["name"],
        "mqblk",
        "the owner still may"
    );

    // shutdown drains and exits 0, and removes the socket.
    api.ok("shutdown", json!({}));
    assert!(d
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    assert!(!path.exists());
}

#[test]
fn save_config_writes_what_recreates_the_running_exports() {
    let _guard = together();
    let dir = TestDir::new();
    let img = dir.image("a.img", 8 * MIB, None);
    let (mut d, mut api) = daemon(
        &dir,
        &[Export::file(dir.join("a.sock"), &img)
            .queues(2)
            .direct(false)],
    );
    api.ok("export_add", json!({"id": "scratch", "socket": dir.join("s.sock"), "engine": "mem", "size": "4M", "threads": 1}));
    api.ok("export_resize", json!({"id": "scratch", "size": "8M"}));
    let saved = dir.join("saved.toml");
    api.ok("save_config", json!({"path": saved}));
    let before: Vec<Value> = api.ok("export_list", json!({})).as_array().unwrap().clone();
    assert!(d.stop().success());

    let api_path = dir.join("api2.sock");
    let mut d2 = Daemon::start_args(
        &dir,
        &[],
        &[
            "--config",
            saved.to_str().unwrap(),
            "--api-socket",
            api_path.to_str().unwrap(),
        ],
    );
    let mut api2 = Api::connect(&api_path);
    let after: Vec<Value> = api2
        .ok("export_list", json!({}))
        .as_array()
        .unwrap()
        .clone();
    let shape = |v: &[Value]| -> Vec<(Value, Value, Value, Value, Value)> {
        v.iter()
            .map(|e| {
                (
                    e["id"].clone(),
                    e["socket"].clone(),
                    e["capacity"].clone(),
                    e["queues"].clone(),
                    e["threads"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        shape(&after),
        shape(&before),
        "{}",
        std::fs::read_to_string(&saved).unwrap()
    );
    assert!(d2.stop().success());
}

#[test]
fn export_set_qos_limits_a_running_export_and_lifts_the_limit() {
    let _guard = together();
    let dir = TestDir::new();
    let sock = dir.join("q.sock");
    let (mut d, mut api) = daemon(&dir, &[]);
    api.ok(
        "export_add",
        json!({"socket": sock, "engine": "null", "size": "64M", "queues": 2}),
    );
    let rate = || {
        let mut w = Workload::new(&sock);
        w.num_queues = 2;
        w.jobs = 2;
        w.iodepth = 16;
        w.pattern = Pattern::RandRead;
        w.runtime = Some(Duration::from_millis(1500));
        let r = mqblk_client::run(&w).expect("workload");
        assert!(r.clean(), "{r}");
        r.iops()
    };
    // What this machine does without a limit, now: the limit below must be well under it, or
    // the limited rate could be the machine's.
    let unlimited = rate();
    assert!(
        unlimited > 2.5 * 1000.0,
        "unlimited, the export ran at only {unlimited:.0} IOPS: too slow to show a 1000 limit"
    );
    let r = api.ok("export_set_qos", json!({"id": "q", "iops-total": 1000}));
    assert_eq!(r["qos"]["iops-total"], "1000", "{r}");
    let limited = rate();
    assert!(
        (800.0..1250.0).contains(&limited),
        "limited to 1000 IOPS, ran at {limited:.0}"
    );
    let got = api.ok("export_get", json!({"id": "q"}));
    assert_eq!(got["config"]["iops-total"], "1000", "{got}");

    let e = api
        .call(
            "export_set_qos",
            json!({"id": "q", "iops-total": 100, "iops-read": 50}),
        )
        .unwrap_err();
    assert!(e.0 == -32602 && e.1.contains("iops-read"), "{e:?}");
    let e = api
        .call("export_set_qos", json!({"id": "q", "queues": 4}))
        .unwrap_err();
    assert!(
        e.0 == -32602 && e.1.contains("'queues' is not a QoS key"),
        "{e:?}"
    );
    let e = api
        .call("export_set_qos", json!({"id": "nope"}))
        .unwrap_err();
    assert_eq!(e.0, -32001);

    let r = api.ok("export_set_qos", json!({"id": "q"}));
    assert_eq!(r["qos"], json!({}), "no key: no limit ({r})");
    let free = rate();
    // Lifted: five times the limit at least, and back to the rate without a limit measured
    // above, within the factor of 4 that other work on a shared 2-CPU machine can cost a 1.5 s
    // run.
    assert!(
        free > 5000.0 && free > unlimited / 4.0,
        "the limit was lifted, yet {free:.0} IOPS ({unlimited:.0} before any limit)"
    );
    assert!(d.stop().success());
}

/// A resize waits for the requests in flight, which under a tight QoS limit takes seconds (a
/// 1 MiB request at 256 KiB/s waits about 4 s);
/// meanwhile the rest of the API (another client's `export_list` and `export_get`) answers at
/// once, and a second resize of the same export waits its turn.
#[test]
fn a_slow_resize_holds_up_no_other_request() {
    let _guard = together();
    let dir = TestDir::new();
    let sock = dir.join("slow.sock");
    let (mut d, mut api) = daemon(&dir, &[]);
    api.ok(
        "export_add",
        json!({"socket": sock, "id": "slow", "engine": "null", "size": "64M", "bps-total": "256K"}),
    );
    api.ok(
        "export_add",
        json!({"socket": dir.join("other.sock"), "id": "other", "engine": "null", "size": "1M"}),
    );
    let client = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            let mut w = Workload::new(&sock);
            w.block_size = MIB as usize;
            w.pattern = Pattern::RandRead;
            w.runtime = Some(Duration::from_secs(6));
            mqblk_client::run(&w).expect("workload")
        })
    };
    // Wait for a request to wait for the limit.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while api.ok("export_get", json!({"id": "slow"}))["status"]["counters"]["throttled"]
        .as_u64()
        .expect("a throttled counter")
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the client's requests were never throttled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let resize = |size: &'static str| {
        let api_sock = dir.join("api.sock");
        std::thread::spawn(move || {
            let mut api = Api::connect(&api_sock);
            let t = std::time::Instant::now();
            api.ok("export_resize", json!({"id": "slow", "size": size}));
            t.elapsed()
        })
    };
    let first = resize("128M");
    // The first resize holds the export's resize turn once it has grown the store (a grow
    // resizes the store before it waits for the threads).
    let capacity =
        |api: &mut Api| api.ok("export_get", json!({"id": "slow"}))["status"]["capacity"].clone();
    assert!(
        wait_until(Duration::from_secs(10), || capacity(&mut api) == 128 * MIB),
        "the first resize never grew the store: {}",
        capacity(&mut api)
    );
    let second = resize("256M");
    // Time for the second request to reach the daemon and wait for its turn. Nothing the
    // daemon shows tells that it has (hence a fixed time, not a condition); if it has not,
    // the check of the capacity below shows nothing, but does not fail.
    std::thread::sleep(Duration::from_millis(100));
    let t = std::time::Instant::now();
    assert_eq!(ids(&mut api), ["slow", "other"]);
    api.ok("export_get", json!({"id": "other"}));
    let answered = t.elapsed();
    // Both resizes are still running, and the second waits for the first: the store has grown
    // to the first's size only (a grow resizes the store before it waits for the threads).
    assert!(
        !first.is_finished() && !second.is_finished(),
        "a resize ended before list and get were answered: the test shows nothing"
    );
    let during = api.ok("export_get", json!({"id": "slow"}));
    assert_eq!(
        during["status"]["capacity"],
        128 * MIB,
        "the second resize ran while the first waited: {during}"
    );
    let first = first.join().unwrap();
    let second = second.join().unwrap();
    assert!(
        first > Duration::from_secs(1),
        "the resize took {first:?}: too fast to show anything (is the QoS limit in force?)"
    );
    assert!(
        answered < Duration::from_millis(500) && answered < first / 2,
        "export_list and export_get took {answered:?} while a resize took {first:?}"
    );
    let got = api.ok("export_get", json!({"id": "slow"}));
    assert_eq!(
        got["status"]["capacity"],
        256 * MIB,
        "{got}; second resize took {second:?}"
    );
    let r = client.join().unwrap();
    assert!(r.clean(), "{r}");
    assert!(d.stop().success());
}

/// A bug that some request reaches ends that request's connection only, with an answer that
/// says so. A debug build's `debug_panic` panics the API thread handling it: the client gets
/// error -32603 and its connection closes. More such panics than the API serves clients at
/// once leave it taking new clients (each connection's place is given back however it ends),
/// a connection opened before them answers on, and the export serves throughout.
#[test]
fn a_panic_while_a_request_is_handled_ends_that_connection_only() {
    if !support::skip::has_test_hooks() {
        return;
    }
    let _guard = together();
    let dir = TestDir::new();
    let img = dir.image("keep.img", 4 * MIB, None);
    let keep = dir.join("keep.sock");
    let (d, mut api) = daemon(&dir, &[Export::file(&keep, &img).direct(false)]);
    let mut c = Client::connect(&keep, 1).expect("connect");

    for i in 0..=mqblk::api::rpc::MAX_CLIENTS {
        let mut panicking = Api::connect(&dir.join("api.sock"));
        let (code, message) = panicking
            .call("debug_panic", json!({}))
            .expect_err("debug_panic answered without an error");
        assert_eq!(code, -32603, "panic {i}: {message}");
        assert!(message.contains("bug"), "panic {i}: {message}");
        assert!(
            panicking.closed_by_daemon(),
            "panic {i}: the connection stayed open"
        );
        if i % 16 == 0 {
            write_and_verify(&mut c, i as u64 * 4096, 4096, i as u64);
        }
    }
    assert!(
        d.log()
            .contains("handling a management API request panicked; closing that connection"),
        "no line about the panics in the daemon's log"
    );
    assert_eq!(
        ids(&mut api).len(),
        1,
        "the connection opened before the panics"
    );
    let mut late = Api::connect(&dir.join("api.sock"));
    late.ok("version", json!({}));
    write_and_verify(&mut c, 0, 64 * 1024, 99);
    drop(c);
    d.terminate();
}
