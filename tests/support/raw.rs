//! One write sent with virtio-driver directly, bypassing libblkio, which refuses writes to a
//! read-only device locally: what checks that the daemon itself refuses them.

use std::time::{Duration, Instant};

use virtio_driver::{
    VhostUser, VirtioBlkFeatureFlags, VirtioBlkQueue, VirtioBlkTransport, VirtioFeatureFlags,
};

use super::mem::SharedMem;

/// Sends one request, bypassing libblkio's read-only check; returns (RO negotiated, completion
/// ret: 0 or -errno).
pub fn raw_write(socket: &std::path::Path, offset: u64, data: &[u8]) -> (bool, i32) {
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
