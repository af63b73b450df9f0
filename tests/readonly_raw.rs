//! Sends a write to a read-only export with virtio-driver directly (libblkio would refuse it
//! locally), to check that the daemon itself refuses it.
mod support;

use std::time::{Duration, Instant};

use support::daemon::*;
use support::mem::SharedMem;
use virtio_driver::{
    VhostUser, VirtioBlkFeatureFlags, VirtioBlkQueue, VirtioBlkTransport, VirtioFeatureFlags,
};

/// Sends one request, bypassing libblkio's read-only check; returns (RO negotiated, completion
/// ret: 0 or -errno).
fn raw_write(socket: &std::path::Path, offset: u64, data: &[u8]) -> (bool, i32) {
    let features = VirtioFeatureFlags::VERSION_1.bits()
        | (VirtioBlkFeatureFlags::RO
            | VirtioBlkFeatureFlags::FLUSH
            | VirtioBlkFeatureFlags::BLK_SIZE)
            .bits();
    let mut t: Box<VirtioBlkTransport> =
        Box::new(VhostUser::new(socket.to_str().unwrap(), features).expect("vhost-user connect"));
    let ro = VirtioBlkFeatureFlags::from_bits_truncate(t.get_features())
        .contains(VirtioBlkFeatureFlags::RO);
    let len = data.len().div_ceil(4096) * 4096;
    let mut buf = SharedMem::new("raw-buf", len);
    buf.as_mut_slice()[..data.len()].copy_from_slice(data);
    let mut queues = VirtioBlkQueue::<u32>::setup_queues(&mut *t, 1, 64).expect("queue setup");
    t.map_mem_region(buf.as_ptr() as usize, len, buf.fd(), 0)
        .expect("map buffer");
    let q = &mut queues[0];
    q.write(offset, &buf.as_mut_slice()[..data.len()], 1)
        .expect("queue write");
    t.get_submission_notifier(0).notify().expect("kick");
    let deadline = Instant::now() + Duration::from_secs(10);
    let ret = loop {
        if let Some(c) = q.completions().next() {
            break c.ret;
        }
        assert!(Instant::now() < deadline, "no completion for the raw write");
        std::thread::sleep(Duration::from_millis(1));
    };
    // The buffer outlives the queues and the transport that map it.
    drop(queues);
    drop(t);
    drop(buf);
    (ro, ret)
}

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
