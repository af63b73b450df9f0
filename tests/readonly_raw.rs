//! Sends a write to a read-only export with virtio-driver directly (libblkio would refuse it
//! locally), to check that the daemon itself refuses it.
mod support;

use support::daemon::*;
use support::raw::raw_write;

#[test]
fn read_only_export_refuses_raw_writes() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", 8 * MIB, Some(3));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img).readonly()]);
    let expected = pattern_bytes(8 * MIB, 0, Some(3));
    let (ro, ret) = raw_write(&sock, 4096, &[0x55; 4096]);
    assert!(ro, "read-only export does not offer VIRTIO_BLK_F_RO");
    assert_ne!(ret, 0, "read-only export accepted a write");
    eprintln!("raw write to read-only export: ret {ret}");
    daemon.terminate();
    assert_file_eq(&img, &expected, "read-only image after a raw write");
}

#[test]
fn raw_write_works_on_writable_export() {
    // Guards the helper: the same write succeeds on a writable export.
    let dir = TestDir::new();
    let img = dir.image("disk.img", 8 * MIB, Some(3));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img)]);
    let (ro, ret) = raw_write(&sock, 4096, &[0x55; 4096]);
    assert!(!ro);
    assert_eq!(ret, 0);
    daemon.terminate();
    assert_eq!(read_file(&img, 4096, 4096), vec![0x55; 4096]);
}
