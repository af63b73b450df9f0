//! QEMU's image locks: mqblk takes the lock bytes qemu-storage-daemon takes for the same export
//! (`engine/image_lock.rs`), so that QEMU's programs refuse to write or resize an image mqblk
//! serves in ways it cannot share, and mqblk refuses to write a qcow2 image that QEMU writes.
//! QEMU's tools are the independent party: what they refuse is QEMU's reading of the bytes.
//!
//! Needs qemu-img and qemu-io (`bash .ci/setup` installs them).
mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use mqblk::engine::image_lock;
use mqblk_client::Client;
use serde_json::json;
use support::api::{daemon_with_api, Api};
use support::daemon::*;
use support::qemu_img::{create_qcow2, qemu_img, qemu_img_ok, qemu_io, qemu_io_ok};
use support::wait::wait_until;

/// `qemu-img ARGS` must fail, saying it cannot take `lock` (QEMU's words: `"write" lock`,
/// `shared "write" lock`, `"resize" lock`).
fn refused(args: &[&str], lock: &str) {
    let (code, text) = qemu_img(args).unwrap();
    assert!(
        code != 0 && text.contains(&format!("Failed to get {lock}")),
        "qemu-img {args:?} exited {code}: {text}"
    );
}

/// While mqblk serves a raw image, `qemu-img resize` is refused (the guest's capacity is the
/// file's size, and nobody else may change it), as qemu-storage-daemon refuses it; reading the
/// image (`qemu-img info`) and writing it (`qemu-io`) are not, since a raw export shares its
/// writes as QSD's does. Once the daemon has stopped, the resize goes through.
#[test]
fn qemu_img_cannot_resize_a_raw_image_mqblk_serves() {
    let dir = TestDir::new();
    let img = dir.image("disk.raw", 16 << 20, None);
    let name = img.display().to_string();
    let sock = dir.join("s.sock");
    let mut d = Daemon::start(&dir, &[Export::file(&sock, &img)]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.write(0, 0, &[0x5a; 4096]).unwrap();
    refused(&["resize", "-f", "raw", &name, "32M"], "\"resize\" lock");
    qemu_img_ok(&["info", "-f", "raw", &name]);
    // Another writer, as a shared disk's, is not forbidden.
    let (code, text) = qemu_io("raw", &img, "write -P 0x11 1M 4k");
    assert_eq!(code, 0, "{text}");
    assert_eq!(c.capacity(), 16 << 20);
    drop(c);
    d.stop();
    qemu_img_ok(&["resize", "-f", "raw", &name, "32M"]);
}

/// While mqblk serves a qcow2 image writable, QEMU cannot open it to write (`qemu-io`), take an
/// internal snapshot in it (`qemu-img snapshot -c`, which would rewrite its tables under
/// mqblk's), resize or amend it, or read it without `-U` (`qemu-img info`, `convert`: its
/// metadata may be changing); with `-U` it can read it, as with qemu-storage-daemon. Once the
/// daemon has stopped, all of them can.
#[test]
fn qemu_cannot_write_a_qcow2_image_mqblk_serves() {
    let (dir, img) = new_qcow2();
    let name = img.display().to_string();
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img).set("format", "qcow2");
    let mut d = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.write(0, 0, &[0x5a; 4096]).unwrap();
    let (code, text) = qemu_io("qcow2", &img, "write -P 0x11 0 4k");
    assert!(
        code != 0 && text.contains("Failed to get \"write\" lock"),
        "qemu-io exited {code}: {text}"
    );
    refused(&["snapshot", "-c", "s1", &name], "\"write\" lock");
    refused(&["resize", &name, "32M"], "\"write\" lock");
    refused(
        &["amend", "-o", "lazy_refcounts=on", &name],
        "\"write\" lock",
    );
    refused(&["info", &name], "shared \"write\" lock");
    let copy = dir.join("copy.raw").display().to_string();
    refused(
        &["convert", "-O", "raw", &name, &copy],
        "shared \"write\" lock",
    );
    qemu_img_ok(&["info", "-U", &name]);
    qemu_img_ok(&["convert", "-U", "-O", "raw", &name, &copy]);
    assert!(c.read_vec(0, 0, 4096).unwrap() == [0x5a; 4096]);
    drop(c);
    d.stop();
    qemu_img_ok(&["snapshot", "-c", "s1", &name]);
    qemu_img_ok(&["resize", &name, "32M"]);
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
}

/// While QEMU writes a qcow2 image (`qemu-io` holding it open), mqblk opens it (as a live
/// migration's destination opens an image its source still serves) and says so, but its queue
/// does not start: one line names the conflict in QEMU's words, and the guest's write waits in
/// its ring. Once QEMU lets go, the same connection's queue starts (tried again every 100 ms)
/// and the write completes. A raw export of the same file is refused at start, since QEMU
/// forbids others to write the qcow2 file.
#[test]
fn mqblk_does_not_write_a_qcow2_image_qemu_writes_and_starts_once_it_is_free() {
    let (dir, img) = new_qcow2();
    let mut qemu = hold_with_qemu_io(&img);

    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img)
        .set("format", "qcow2")
        .set("id", "disk");
    let (d, mut api) = daemon_with_api(&dir, &[export]);
    let waiting = |api: &mut Api| {
        api.ok("export_get", json!({"id": "disk"}))["status"]["waiting_for_disk"]
            .as_bool()
            .unwrap()
    };
    assert!(!waiting(&mut api), "waiting with no frontend");
    assert!(
        d.log()
            .contains("is in use by another process: it forbids others to write"),
        "{}",
        d.log()
    );

    // A raw export of the qcow2 file: refused at start, in one line.
    let raw_sock = dir.join("raw.sock");
    let e = serve_fails(
        &export_arg(Export::file(&raw_sock, &img).spec()),
        Duration::from_secs(10),
    );
    assert!(
        e.contains("in use by another process") && e.contains("forbids others to write"),
        "{e}"
    );

    let mut c = Client::connect(&sock, 1).unwrap();
    c.set_timeout(Duration::from_secs(20));
    let released = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(
                d.wait_for_log("cannot take up the disk", Duration::from_secs(10)),
                "{}",
                d.log()
            );
            assert!(
                wait_until(Duration::from_secs(5), || waiting(&mut api)),
                "export_get does not say the queues wait for the disk"
            );
            // Long enough for a write that went through despite the lock to have completed.
            std::thread::sleep(Duration::from_millis(500));
            *released.lock().unwrap() = Some(std::time::Instant::now());
            qemu.kill().unwrap();
            qemu.wait().unwrap();
        });
        c.write(0, 0, &[0x5a; 4096]).unwrap();
        let done = std::time::Instant::now();
        let released = released
            .lock()
            .unwrap()
            .expect("the write completed while QEMU held the image");
        assert!(released <= done);
    });
    assert!(
        d.log().contains("took up the disk after waiting"),
        "{}",
        d.log()
    );
    assert!(
        wait_until(Duration::from_secs(5), || !waiting(&mut api)),
        "export_get still says the queues wait for the disk"
    );
    assert!(c.read_vec(0, 0, 4096).unwrap() == [0x5a; 4096]);
    drop(c);
    d.terminate();
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
}

/// A test directory with a new 16 MiB qcow2 image in it, and the image's path.
fn new_qcow2() -> (TestDir, std::path::PathBuf) {
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    create_qcow2(&img, "16M");
    (dir, img)
}

/// `qemu-io` with the qcow2 image at `path` open for writing (its commands come from standard
/// input, which stays open), once it holds QEMU's lock of the write permission (byte 101). The
/// probe takes no lock: one that did (`qemu-img info`) could make qemu-io's own start fail.
fn hold_with_qemu_io(path: &Path) -> Child {
    let name = path.display().to_string();
    let child = Command::new("qemu-io")
        .args(["-f", "qcow2", &name])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("running qemu-io (bash .ci/setup installs it)");
    assert!(
        wait_until(Duration::from_secs(10), || byte_locked(path, 101)),
        "qemu-io did not lock {name}"
    );
    child
}

/// Whether some open file description holds a lock on byte `at` of the file at `path`.
fn byte_locked(path: &Path, at: i64) -> bool {
    let file = std::fs::File::open(path).unwrap();
    let kind = image_lock::ofd(&file, libc::F_OFD_GETLK, libc::F_WRLCK as i16, at).unwrap();
    kind != libc::F_UNLCK as i16
}
