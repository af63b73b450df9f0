//! Online resize with a real Linux guest: QEMU 10 (TCG) boots a busybox guest
//! (`tests/guest/init-resize`) on a vhost-user-blk disk served by `mqblk serve`; while it runs,
//! this test grows the export and then shrinks it through the management API. The guest is told
//! nothing but what the disk tells it (mqblk sends the frontend a config-change message, QEMU
//! raises a config interrupt): it must see each new capacity in /sys/block/vda/size, write and
//! read back the grown disk's last MiB, and find reads past the shrunk end refused. The test
//! checks the guest's report, the tail in the image file, and the file's length after each
//! step.
//!
//! Needs what `bash .ci/setup` installs (QEMU, busybox-static, the guest kernel).
mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::api::Api;
use support::daemon::{file_len, read_file, write_image, MIB, SHUTDOWN_TIMEOUT, STARTUP_TIMEOUT};
use support::qemu::{log_section, read_lossy, report_line, GuestBoot, Qemu, WorkDir};

/// The disk at boot, grown to, and shrunk to.
const BOOT: u64 = 32 * MIB;
const GROWN: u64 = 48 * MIB;
const SHRUNK: u64 = 16 * MIB;
/// Longest wait for each line of the guest's report.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Waits until the console has a report line starting with `prefix`; returns it.
fn wait_line(
    dir: &WorkDir,
    prefix: &str,
    qemu: &mut support::proc::Proc,
) -> Result<String, String> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let console = read_lossy(&dir.console);
        if let Some(l) = console
            .lines()
            .filter_map(report_line)
            .find(|l| l.starts_with(prefix))
        {
            return Ok(l.to_string());
        }
        if let Some(l) = console
            .lines()
            .filter_map(report_line)
            .find(|l| l.starts_with("RESULT FAIL"))
        {
            return Err(format!("the guest failed before '{prefix}': {l}"));
        }
        if let Ok(Some(status)) = qemu.try_wait() {
            return Err(format!(
                "QEMU exited ({status}) before the guest said '{prefix}'"
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no '{prefix}' from the guest within {STEP_TIMEOUT:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn sectors(line: &str) -> u64 {
    line.split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size in '{line}'"))
}

#[test]
fn a_guest_sees_the_disk_grow_and_shrink_without_a_reboot() {
    let boot = GuestBoot::prepare_with(
        "tests/guest/mkinitramfs.sh",
        &["init-resize", "initramfs-resize"],
    );
    let dir = WorkDir::new("mqblk-resize.");
    write_image(&dir.image, BOOT, None);
    let api_socket = dir.path.join("api.sock");
    let log = dir.path.join("backend.log");
    let mut cmd = support::qemu::mqblk_serve(&support::daemon::mqblk_bin(), &dir, 1);
    cmd.arg("--api-socket").arg(&api_socket);
    let mut server = support::proc::Proc::spawn_logged("mqblk".into(), &mut cmd, &log);
    if let Err(e) = server.wait_for_socket(&dir.socket, STARTUP_TIMEOUT, || true) {
        panic!("{e}\n{}", log_section("mqblk", &log, 40));
    }
    let mut api = Api::connect(&api_socket);
    let id = "vub";

    let mut qemu = boot.spawn_qemu(
        &dir,
        Qemu {
            smp: 1,
            cpu: None,
            chardev_extra: String::new(),
            queues: 1,
            append: "console=ttyS0 panic=-1 quiet".into(),
        },
    );
    let report = |dir: &WorkDir| {
        format!(
            "{}\n{}\n{}",
            log_section("guest console", &dir.console, 40),
            log_section("mqblk", &log, 40),
            log_section("QEMU", &dir.qemu_log, 20)
        )
    };
    let step = |prefix: &str, qemu: &mut support::proc::Proc| {
        wait_line(&dir, prefix, qemu).unwrap_or_else(|e| panic!("{e}\n{}", report(&dir)))
    };

    let size = step("SIZE", &mut qemu);
    assert_eq!(sectors(&size), BOOT / 512, "{size}");

    let r = api.ok("export_resize", json!({"id": id, "size": GROWN}));
    assert_eq!(r["capacity"], GROWN, "{r}");
    assert_eq!(
        file_len(&dir.image),
        GROWN,
        "the image grew with the export"
    );
    let grew = step("GREW", &mut qemu);
    assert_eq!(sectors(&grew), GROWN / 512, "{grew}");
    let tail = step("TAIL", &mut qemu);
    assert_eq!(tail, "TAIL ok", "{}", report(&dir));
    let expected: Vec<u8> = b"mqblk-resize-tail\n"
        .iter()
        .copied()
        .cycle()
        .take(MIB as usize)
        .collect();
    assert!(
        read_file(&dir.image, GROWN - MIB, MIB as usize) == expected,
        "the guest's tail is not in the image's last MiB"
    );

    let r = api.ok("export_resize", json!({"id": id, "size": SHRUNK}));
    assert_eq!(r["capacity"], SHRUNK, "{r}");
    let shrank = step("SHRANK", &mut qemu);
    assert_eq!(sectors(&shrank), SHRUNK / 512, "{shrank}");
    step("PAST", &mut qemu);
    let result = step("RESULT", &mut qemu);
    assert_eq!(result, "RESULT PASS", "{}", report(&dir));
    assert_eq!(
        qemu.wait_timeout(Duration::from_secs(30))
            .ok()
            .flatten()
            .map(|s| s.success()),
        Some(true)
    );
    assert_eq!(
        file_len(&dir.image),
        SHRUNK,
        "nothing wrote past the shrunk end"
    );
    let failures = server.terminate(SHUTDOWN_TIMEOUT);
    assert!(failures.is_empty(), "{failures:?}\n{}", report(&dir));
}
