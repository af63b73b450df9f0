//! Operator and startup errors: every bad setting or unusable file gets one clear line on
//! stderr and a non-zero exit; a full disk fails only the writes that hit it (IOERR) while the
//! daemon goes on serving and exits 0 on SIGTERM.
//!
//! Some cases need root (they mount a tmpfs or ramfs) or, run as root, setpriv (to drop
//! privileges); where they cannot run they fail, unless `MQBLK_TEST_ALLOW_NO_MOUNT=1` or
//! `MQBLK_TEST_ALLOW_NO_SETPRIV=1` says that skipping them is expected: then they print
//! `SKIPPED` with the reason.
mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use mqblk_client::{fill_pattern, Client, ConnectOptions};
use support::daemon::*;
use support::mount::Mount;
use support::skip::skip_unless_allowed;

/// How long `mqblk serve` may take to refuse bad input.
const START: Duration = Duration::from_secs(10);

/// Asserts that `line` contains every one of `want`.
fn says(line: &str, want: &[&str], what: &str) {
    for w in want {
        assert!(line.contains(w), "{what}: {line:?} does not say {w:?}");
    }
    eprintln!("ok   {what}: {line}");
}

/// The stderr of `mqblk serve ARGS`, which must end in a usage error (exit code 2).
fn usage_error(args: &[&str]) -> String {
    let out = Command::new(mqblk_bin())
        .arg("serve")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    stderr
}

#[test]
fn bad_export_values_are_refused_with_the_key_named() {
    let dir = TestDir::new();
    let sock = dir.join("s.sock");
    let img = dir.image("disk.img", MIB, None);
    let base = format!("socket={},path={}", sock.display(), img.display());
    let null = format!("socket={},engine=null,size=1M", sock.display());
    // (spec, what the message must say)
    let mut cases: Vec<(String, Vec<&str>)> = vec![
        (
            format!("{base},colour=blue"),
            vec!["unknown key 'colour'", "known keys"],
        ),
        (format!("{base},queues"), vec!["'queues' has no value"]),
        (
            format!("{base},queues=1,queues=2"),
            vec!["'queues' is given twice"],
        ),
        (
            format!("path={}", img.display()),
            vec!["socket=PATH is required"],
        ),
        (
            format!("socket={}", sock.display()),
            vec!["path=PATH is required"],
        ),
        (
            format!("{base},engine=floppy"),
            vec!["invalid engine=floppy", "uring, null, mem, rbd or nvme"],
        ),
        (
            format!("socket={},engine=null", sock.display()),
            vec!["size=BYTES is required"],
        ),
        (
            format!("socket={},engine=mem", sock.display()),
            vec!["size=BYTES is required"],
        ),
        (
            format!("socket={},engine=null,size=abc", sock.display()),
            vec!["invalid size=abc", "multiple of 512"],
        ),
        (
            format!("socket={},engine=null,size=0", sock.display()),
            vec!["invalid size=0"],
        ),
        (
            format!("socket={},engine=null,size=1000", sock.display()),
            vec!["invalid size=1000"],
        ),
        (
            format!("socket={},engine=null,size=99999999999T", sock.display()),
            vec!["invalid size="],
        ),
        (
            format!("{base},queues=0"),
            vec!["invalid queues=0", "1 to 64"],
        ),
        (format!("{base},queues=65"), vec!["invalid queues=65"]),
        (format!("{base},queues=-1"), vec!["invalid queues=-1"]),
        (
            format!("{base},queue-size=3"),
            vec!["invalid queue-size=3", "power of two"],
        ),
        (format!("{base},queue-size=1"), vec!["invalid queue-size=1"]),
        (
            format!("{base},queue-size=65536"),
            vec!["invalid queue-size=65536"],
        ),
        (
            format!("{base},threads=0"),
            vec!["invalid threads=0", "per-queue"],
        ),
        (format!("{base},threads=many"), vec!["invalid threads=many"]),
        (format!("{base},threads=65"), vec!["invalid threads=65"]),
        (
            format!("{base},cpus=abc"),
            vec!["invalid cpus=abc", "CPU list"],
        ),
        (
            format!("{base},cpus=5000"),
            vec!["invalid cpus=5000", "below 1024"],
        ),
        (format!("{base},cpus=3-1"), vec!["invalid cpus=3-1"]),
        (
            format!("{base},queues=4,cpus=0-1"),
            vec!["invalid cpus=", "one CPU per I/O thread"],
        ),
        (
            format!("{base},readonly=maybe"),
            vec!["invalid readonly=maybe", "on or off"],
        ),
        (
            format!("{base},direct=sometimes"),
            vec!["invalid direct=sometimes", "on or off"],
        ),
        (
            format!("{base},serial=123456789012345678901"),
            vec!["invalid serial=", "at most 20 bytes"],
        ),
        (
            format!("{base},poll=always"),
            vec!["invalid poll=always", "off, on or adaptive"],
        ),
        (
            format!("{base},poll-max-us=20000"),
            vec!["invalid poll-max-us=20000"],
        ),
        (
            format!("{base},batch-wait-us=5000"),
            vec!["invalid batch-wait-us=5000"],
        ),
        (
            format!("{base},merge=2"),
            vec!["invalid merge=2", "on or off"],
        ),
        (
            "fd=three,engine=null,size=1M".into(),
            vec!["invalid fd=three", "file descriptor number"],
        ),
        (
            format!("{null},fd=3"),
            vec!["socket= and fd= exclude each other"],
        ),
        (
            "engine=null,size=1M".into(),
            vec!["socket=PATH is required", "or fd=N"],
        ),
        (
            format!("{null},bps-write=1x"),
            vec!["invalid bps-write=1x", "K/M/G/T"],
        ),
        (
            format!("{null},iops-total=100,iops-read=50"),
            vec!["invalid iops-read=50", "not together with iops-total"],
        ),
        (
            format!("{null},iops-total-max=500"),
            vec!["invalid iops-total-max=500", "needs iops-total"],
        ),
    ];
    // Without the rbd feature (the default build) engine=rbd is a known engine that this
    // build cannot serve, and the message says how to get one that can.
    if !cfg!(feature = "rbd") {
        cases.push((
            format!("socket={},engine=rbd,pool=p,image=i", sock.display()),
            vec![
                "engine=rbd needs mqblk built with the rbd feature",
                "--features rbd",
            ],
        ));
    }
    for (spec, want) in &cases {
        let line = serve_fails(&export_arg(spec), START);
        says(&line, want, spec);
        assert!(
            line.contains("--export"),
            "{spec}: {line:?} does not name --export"
        );
    }

    // Whole-command errors.
    let line = serve_fails(&[], START);
    says(&line, &["no export given"], "no --export");
    let mut two = export_arg(&null);
    two.extend(export_arg(&null));
    let line = serve_fails(&two, START);
    says(
        &line,
        &["two exports use socket=", "its own socket"],
        "same socket twice",
    );
    let mut two_fds = export_arg("fd=3,id=a,engine=null,size=1M");
    two_fds.extend(export_arg("fd=3,id=b,engine=null,size=1M"));
    let line = serve_fails(&two_fds, START);
    says(&line, &["two exports use fd=3"], "same fd twice");
    // The metrics port is taken before any export starts: nothing is left behind.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let mut metrics = export_arg(&null);
    metrics.extend(["--metrics".to_string(), addr.clone()]);
    let line = serve_fails(&metrics, START);
    says(
        &line,
        &[&format!("cannot serve metrics on {addr}"), "in use"],
        "--metrics on a busy port",
    );
    // clap refuses these values itself: a usage error (exit code 2) naming the flag.
    says(
        &usage_error(&["--export", &null, "--metrics", "localhost"]),
        &[
            "--metrics",
            "localhost is not an IP address and port",
            "127.0.0.1:9189",
        ],
        "--metrics localhost",
    );
    says(
        &usage_error(&["--export", &null, "--table-memory-total", "1M"]),
        &[
            "--table-memory-total",
            "1M is not a size of at least 16M",
            "8G",
        ],
        "--table-memory-total 1M",
    );
    // Two members of one throttle group with different limits: the second is refused when
    // it starts, and neither leaves its socket behind.
    let (ga, gb) = (dir.join("ga.sock"), dir.join("gb.sock"));
    let mut group = export_arg(format!(
        "socket={},engine=null,size=1M,iops-total=100,group=g",
        ga.display()
    ));
    group.extend(export_arg(format!(
        "socket={},engine=null,size=1M,iops-total=200,group=g",
        gb.display()
    )));
    let line = serve_fails(&group, START);
    says(
        &line,
        &[
            "invalid group=g",
            "the group's limits are iops-total=100, not iops-total=200",
        ],
        "one group, two limits",
    );
    assert!(
        !ga.exists() && !gb.exists(),
        "a refused start left a socket behind"
    );
    let mut lvl = export_arg(&null);
    lvl.extend(["--log-level".to_string(), "chatty".to_string()]);
    let line = serve_fails(&lvl, START);
    says(&line, &["invalid --log-level chatty"], "--log-level chatty");
    let missing = dir.join("nope.toml");
    let line = serve_fails(&["--config".into(), missing.display().to_string()], START);
    says(
        &line,
        &["cannot read --config", "nope.toml"],
        "--config missing",
    );
    let bad_toml = dir.join("bad.toml");
    std::fs::write(
        &bad_toml,
        format!(
            "[[export]]\nsocket = \"{}\"\nengine = \"null\"\nsize = \"1M\"\nqueues = 99\n",
            sock.display()
        ),
    )
    .unwrap();
    let line = serve_fails(&["--config".into(), bad_toml.display().to_string()], START);
    says(
        &line,
        &["[[export]] #1", "invalid queues=99"],
        "--config with queues = 99",
    );
    let bad_key = dir.join("badkey.toml");
    std::fs::write(&bad_key, "[[export]]\nsokcet = \"/tmp/x\"\n").unwrap();
    // A TOML syntax or schema error quotes the offending line: several lines, the first one
    // naming the file.
    let text = serve_fails_stderr(&["--config".into(), bad_key.display().to_string()], START);
    says(
        &text,
        &["--config", "badkey.toml", "unknown field `sokcet`"],
        "--config with a misspelt key",
    );
    assert!(!sock.exists(), "a refused start left a socket behind");
}

#[test]
fn unusable_images_and_sockets_are_refused_clearly() {
    let dir = TestDir::new();
    let sock = dir.join("s.sock");
    let spec = |path: &Path, extra: &str| {
        export_arg(format!(
            "socket={},path={}{extra}",
            sock.display(),
            path.display()
        ))
    };

    let line = serve_fails(&spec(&dir.join("missing.img"), ""), START);
    says(
        &line,
        &["missing.img does not exist", "pass size=BYTES"],
        "image missing, no size=",
    );
    let link = dir.join("dangling.img");
    std::os::unix::fs::symlink(dir.join("gone"), &link).unwrap();
    let line = serve_fails(&spec(&link, ""), START);
    says(&line, &["dangling.img does not exist"], "dangling symlink");
    let img = dir.image("disk.img", 4 * MIB, None);
    let line = serve_fails(&spec(&img, ",size=8M"), START);
    says(
        &line,
        &["size=8388608 but", "is 4194304 bytes"],
        "size mismatch",
    );
    let tiny = dir.join("tiny.img");
    std::fs::write(&tiny, [0u8; 100]).unwrap();
    let line = serve_fails(&spec(&tiny, ",direct=off"), START);
    says(
        &line,
        &["tiny.img is smaller than 512 bytes"],
        "100-byte image",
    );
    let notdir = dir.join("disk.img").join("inside.img");
    let line = serve_fails(&spec(&notdir, ""), START);
    says(
        &line,
        &["inside.img", "Not a directory"],
        "image path under a regular file",
    );
    let line = serve_fails(&spec(dir.path(), ",direct=off"), START);
    says(
        &line,
        &["cannot open", "Is a directory"],
        "image is a directory",
    );
    assert!(!sock.exists());

    // Unreadable image: chmod 000. Root ignores file modes, so run the daemon as nobody.
    let locked_dir = dir.join("locked");
    std::fs::create_dir(&locked_dir).unwrap();
    std::fs::set_permissions(&locked_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let locked = locked_dir.join("locked.img");
    write_image(&locked, MIB, None);
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    let lsock = locked_dir.join("l.sock");
    let args = export_arg(format!(
        "socket={},path={},direct=off",
        lsock.display(),
        locked.display()
    ));
    let root = rustix::process::geteuid().is_root();
    if !root {
        let line = serve_fails(&args, START);
        says(
            &line,
            &["cannot open", "locked.img", "Permission denied"],
            "chmod 000 image",
        );
    } else if Command::new("setpriv").arg("--version").output().is_ok() {
        let bin = mqblk_bin();
        let mut full = vec![
            "--reuid=65534".to_string(),
            "--regid=65534".into(),
            "--clear-groups".into(),
            bin.display().to_string(),
            "serve".into(),
        ];
        full.extend(args.clone());
        let out = Command::new("setpriv").args(&full).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or_default();
        assert_eq!(
            out.status.code(),
            Some(1),
            "chmod 000 image as nobody: {stderr}"
        );
        says(
            last,
            &[
                "mqblk: error: cannot open",
                "locked.img",
                "Permission denied",
            ],
            "chmod 000 image (daemon run as nobody)",
        );
    } else {
        skip_unless_allowed(
            "MQBLK_TEST_ALLOW_NO_SETPRIV",
            "chmod 000 image: running as root, and setpriv is missing to drop privileges",
        );
    }

    // A read-only filesystem: a writable export cannot open its image for writing.
    if let Some(m) = Mount::new(&dir, "ro", "tmpfs", "size=4m") {
        let ro_img = m.path().join("disk.img");
        write_image(&ro_img, MIB, None);
        m.remount_ro();
        let line = serve_fails(&spec(&ro_img, ",direct=off"), START);
        says(
            &line,
            &["cannot open", "Read-only file system"],
            "image on a read-only mount",
        );
        // ... but serving it read-only works.
        let d = Daemon::start(
            &dir,
            &[Export::file(&sock, &ro_img).readonly().direct(false)],
        );
        let mut c = Client::connect(&sock, 1).expect("read-only export on a ro mount");
        c.read_vec(0, 0, 4096).expect("read from a ro mount");
        drop(c);
        d.terminate();
    }

    // O_DIRECT refused: ramfs has no direct I/O (tmpfs has it since Linux 6.6).
    if let Some(m) = Mount::new(&dir, "ramfs", "ramfs", "") {
        let r_img = m.path().join("disk.img");
        write_image(&r_img, MIB, None);
        let line = serve_fails(&spec(&r_img, ""), START);
        says(
            &line,
            &["refuses O_DIRECT", "pass direct=off"],
            "direct=on on ramfs",
        );
        let line = serve_fails(&spec(&r_img, ",direct=on"), START);
        says(
            &line,
            &["refuses O_DIRECT", "pass direct=off"],
            "direct=on (explicit) on ramfs",
        );
    }
}

#[test]
fn busy_or_wrong_socket_paths_are_refused() {
    let dir = TestDir::new();
    let sock = dir.join("busy.sock");
    let img = dir.image("disk.img", 4 * MIB, Some(1));
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img)]);

    // Another mqblk on the same socket: refused, and the first keeps serving.
    let img2 = dir.image("disk2.img", 4 * MIB, None);
    let line = serve_fails(
        &export_arg(format!("socket={},path={}", sock.display(), img2.display())),
        START,
    );
    says(
        &line,
        &["busy.sock is busy", "another process is listening"],
        "socket busy",
    );
    let mut c = Client::connect(&sock, 1).expect("the first daemon still serves");
    c.read_vec(0, 0, 4096).expect("read from the first daemon");
    drop(c);

    // A regular file where the socket should go: refused, the file left alone.
    let file = dir.join("file.sock");
    std::fs::write(&file, b"precious").unwrap();
    let line = serve_fails(&export_arg(Export::null(&file, MIB).spec()), START);
    says(
        &line,
        &["file.sock exists and is not a socket"],
        "socket path is a regular file",
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");

    // A directory that does not exist.
    let nodir = dir.join("no/such/dir/x.sock");
    let line = serve_fails(&export_arg(Export::null(&nodir, MIB).spec()), START);
    says(
        &line,
        &["cannot listen on socket", "x.sock"],
        "socket in a missing directory",
    );

    // The second of two exports fails: the whole start fails, and the first one's socket is
    // not left behind.
    let a = dir.join("first.sock");
    let mut args = export_arg(Export::null(&a, MIB).spec());
    args.extend(export_arg(Export::null(&file, MIB).spec()));
    let line = serve_fails(&args, START);
    says(
        &line,
        &["file.sock exists and is not a socket"],
        "second export fails",
    );
    assert!(!a.exists(), "the first export's socket was left behind");

    // --api-socket pointing at a disk image (a typo): refused, the image left intact, and the
    // export started before it not left behind.
    let typo = dir.image("typo.img", MIB, Some(3));
    let before = std::fs::read(&typo).unwrap();
    let b = dir.join("before-api.sock");
    let mut args = vec!["--api-socket".to_string(), typo.display().to_string()];
    args.extend(export_arg(Export::null(&b, MIB).spec()));
    let line = serve_fails(&args, START);
    says(
        &line,
        &[
            "--api-socket",
            "typo.img: the path exists and is not a socket",
        ],
        "API socket path is a disk image",
    );
    assert!(
        std::fs::read(&typo).unwrap() == before,
        "the image was changed"
    );
    assert!(!b.exists(), "the export's socket was left behind");

    // A stale socket (nobody listening) is replaced.
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let d2 = Daemon::start(&dir, &[Export::file(&stale, &img2)]);
    Client::connect(&stale, 1).expect("served on a replaced stale socket");
    d2.terminate();
    daemon.terminate();
}

/// A full disk: the writes that do not fit fail with IOERR (libblkio: EIO), reads and the
/// other export go on, and the daemon exits 0 on SIGTERM.
#[test]
fn full_disk_fails_writes_with_ioerr_and_the_daemon_goes_on() {
    let dir = TestDir::new();
    let Some(m) = Mount::new(&dir, "small", "tmpfs", "size=4m") else {
        return; // reported as SKIPPED by Mount::new
    };
    // 16 MiB sparse image on a 4 MiB filesystem.
    let img = m.path().join("sparse.img");
    write_image(&img, 16 * MIB, None);
    let other_img = dir.image("other.img", 4 * MIB, Some(9));
    let (sock, other) = (dir.join("full.sock"), dir.join("other.sock"));
    let daemon = Daemon::start(
        &dir,
        &[
            Export::file(&sock, &img).direct(false),
            Export::file(&other, &other_img),
        ],
    );
    let mut c = Client::connect(&sock, 1).expect("connect");
    let mut o = Client::connect(&other, 1).expect("connect to the other export");
    let chunk = 256 * KIB as usize;
    let mut buf = vec![0u8; chunk];
    let (mut ok, mut eio) = (0u64, 0u64);
    let mut first_fail = None;
    for i in 0..(16 * MIB / chunk as u64) {
        let off = i * chunk as u64;
        fill_pattern(&mut buf, off, 77);
        match c.write(0, off, &buf) {
            Ok(()) => ok += 1,
            Err(e) => {
                assert_eq!(
                    e.errno(),
                    Some(libc::EIO),
                    "a write on a full disk must fail with IOERR (EIO), got {e}"
                );
                eio += 1;
                first_fail.get_or_insert(off);
            }
        }
        // The other export is unaffected.
        o.read_vec(0, (i * 4096) % (4 * MIB), 4096)
            .expect("the other export read during the full disk");
    }
    eprintln!(
        "full disk: {ok} writes of {chunk} bytes succeeded, {eio} failed with EIO (first at offset {first_fail:?})"
    );
    assert!(ok > 0 && eio > 0, "the disk should have filled part way");
    // What was written reads back; the daemon still serves flushes and reads.
    let v = c.read_vec(0, 0, chunk).expect("read after the disk filled");
    let mut want = vec![0u8; chunk];
    fill_pattern(&mut want, 0, 77);
    assert!(v == want, "data written before the disk filled reads back");
    c.flush(0).expect("flush after the disk filled");
    // Writes keep failing cleanly, and a write into space already allocated still works.
    let e = c.write(0, 15 * MIB, &buf).expect_err("still full");
    assert_eq!(e.errno(), Some(libc::EIO));
    c.write(0, 0, &buf)
        .expect("overwrite of allocated blocks on a full disk");
    drop(c);
    drop(o);
    // A new connection works too.
    let mut c = connect_retry(&sock, &ConnectOptions::new(1))
        .unwrap_or_else(|e| panic!("reconnect after the disk filled: {e}"));
    c.read_vec(0, 0, 4096).expect("read on the new connection");
    drop(c);
    assert!(
        daemon.log().contains("I/O error"),
        "the daemon logs the I/O errors"
    );
    daemon.terminate();
}
