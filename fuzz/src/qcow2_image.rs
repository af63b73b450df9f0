//! A qcow2 image of arbitrary bytes, served as mqblk serves an export: its header checks
//! (`mqblk::format::qcow2`) and imago's open of the image (writable, with `metadata-commit=flush`
//! for inputs of odd length, `write` for the others); for a writable one, a resize by 1 MiB
//! (an `export_resize` before any frontend connects), then what the daemon
//! does before its first queue starts (`Engine::refresh`: imago's write-back, mqblk's own check
//! and mending of the refcounts of the image's tables, imago's cache dropped); then a guest's
//! reads (and, writable, a write, a discard and a flush) through a channel as an I/O thread
//! drives one, which reach the image's tables through imago on the metadata worker. An image is the operator's input, and in a cloud often a tenant's upload: a
//! malformed one must be refused with an error, never panic or exhaust the daemon.
//!
//! What the image file takes of its filesystem is bounded too: a few writes must not make it
//! take more than [`MOST_TAKEN`] (an image's refcounts can put its first free cluster far past
//! its end, and the room up to it was once taken, from a filesystem other images share).
//!
//! The image is a file of the harness's own (`/dev/shm/mqblk-fuzz-qcow2-PID.img`), rewritten
//! for each input. The header's backing file name is cut off (its offset and length zeroed) so that no input
//! makes the harness open a file of the host; the backing chain's checks have tests of their
//! own.

use mqblk::engine::{Channel, Engine, Op, Started};

/// Bytes of the header that name the backing file (offset and length).
const BACKING_NAME: std::ops::Range<usize> = 8..20;

/// The most the image file may take of its filesystem after the requests of [`serve`]: an L1
/// table grown to its largest (32 MiB), a refcount table grown to its largest (8 MiB), the
/// file grown ahead (up to 16 MiB) and a few clusters, with room to spare.
const MOST_TAKEN: u64 = 128 << 20;

/// Opens `data` as a qcow2 image, read-only and then writable; refreshes the writable one.
pub fn run(data: &[u8]) {
    let mut image = data.to_vec();
    if let Some(name) = image.get_mut(BACKING_NAME) {
        name.fill(0);
    }
    // A file with a name (the chain is resolved by path), on a tmpfs where there is one,
    // rewritten for every input.
    let dir = ["/dev/shm", "/tmp"]
        .into_iter()
        .find(|d| std::path::Path::new(d).is_dir())
        .unwrap_or(".");
    let path = format!("{dir}/mqblk-fuzz-qcow2-{}.img", std::process::id());
    std::fs::write(&path, &image).expect("writing the image");
    // Half the inputs (by length) are served writable with `metadata-commit=flush`: the dirty
    // mark is written into the header and cleared at the flush (and the open checks whether a
    // live server holds a mark the input may carry).
    let commit = if data.len() % 2 == 1 { "flush" } else { "write" };
    for readonly in ["on", "off"] {
        let spec = format!(
            "socket=/nonexistent.sock,path={path},format=qcow2,direct=off,readonly={readonly},\
             metadata-commit={commit}"
        );
        let cfg = mqblk::config::parse_export_spec(&spec).expect("a valid export spec");
        if let Ok(engine) = mqblk::engine::open(&cfg) {
            let writable = readonly == "off";
            if writable {
                // An operator may grow an export before its frontend connects: growing
                // allocates (a new L1 table) before any queue's start has checked the tables.
                let _ = engine.resize(Some(engine.capacity().saturating_add(1 << 20)));
            }
            // As the daemon does: a writable image's queues start only once `refresh` has
            // checked (and mended) its tables' refcounts.
            if !writable || engine.refresh().is_ok() {
                serve(&*engine, writable);
            }
        }
    }
    use std::os::unix::fs::MetadataExt;
    let taken = std::fs::metadata(&path).map_or(0, |m| m.blocks() * 512);
    assert!(
        taken <= MOST_TAKEN,
        "a {}-byte image took {taken} bytes of its filesystem",
        data.len()
    );
}

/// A few requests, as a guest would make them, through a channel of `engine`: reads at the
/// start, the middle and the end of the disk, and, `writable`, a write and a read at each of
/// those places, a discard and a flush. Results do not matter (a corrupt image may fail any of them); each must complete.
fn serve(engine: &dyn Engine, writable: bool) {
    let (Ok(mut channel), Ok(mut ring)) = (engine.channel(), io_uring::IoUring::new(4)) else {
        return;
    };
    let capacity = engine.capacity();
    let mut buf = vec![0u8; 4096];
    let mut at = vec![0, 4096, capacity / 2 / 512 * 512];
    at.push(capacity.saturating_sub(4096) / 512 * 512);
    for &offset in &at {
        rw(&mut *channel, &mut ring, &mut buf, offset, capacity, false);
    }
    if writable {
        // Writes allocate: each where the reads were, each read back.
        buf.fill(0x5a);
        for &offset in &at {
            rw(&mut *channel, &mut ring, &mut buf, offset, capacity, true);
            rw(&mut *channel, &mut ring, &mut buf, offset, capacity, false);
        }
        perform(
            &mut *channel,
            &mut ring,
            &Op::Discard {
                offset: 0,
                len: capacity.min(8192),
            },
        );
        perform(&mut *channel, &mut ring, &Op::Flush);
    }
}

/// A read (or write) of `buf` at `offset`, cut where the channel says a run ends, as an I/O
/// thread cuts it.
fn rw(
    channel: &mut dyn Channel,
    ring: &mut io_uring::IoUring,
    buf: &mut [u8],
    mut offset: u64,
    capacity: u64,
    write: bool,
) {
    let (start, end) = (offset, (offset + buf.len() as u64).min(capacity));
    while offset < end {
        let run_end = channel
            .run_end(offset, end - offset)
            .clamp(offset + 512, end);
        let from = (offset - start) as usize;
        let iov = libc::iovec {
            iov_base: buf[from..].as_mut_ptr().cast(),
            iov_len: (run_end - offset) as usize,
        };
        let op = match write {
            true => Op::Write {
                offset,
                iovs: &iov,
                iovcnt: 1,
                sync: false,
                buf_index: None,
            },
            false => Op::Read {
                offset,
                iovs: &iov,
                iovcnt: 1,
                buf_index: None,
            },
        };
        perform(channel, ring, &op);
        offset = run_end;
    }
}

/// Starts `op` and waits for its result, wherever the channel performs it.
fn perform(channel: &mut dyn Channel, ring: &mut io_uring::IoUring, op: &Op) -> i32 {
    const TOKEN: u64 = 7;
    // SAFETY: the iovecs of `op` name live buffers that outlive the wait below.
    match unsafe { channel.start(op, TOKEN) } {
        Started::Done(res) => res,
        Started::Ring(entry) => {
            // SAFETY: as above; the entry is waited for before returning.
            unsafe { ring.submission().push(&entry) }.expect("a free entry");
            // A signal (libFuzzer's timeout alarm) can end the wait early: io_uring_enter then
            // returns what it submitted, with no completion yet.
            loop {
                match ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                    Err(e) => panic!("io_uring_enter: {e}"),
                }
                if let Some(c) = ring.completion().next() {
                    break c.result();
                }
            }
        }
        Started::WideRing(_) => panic!("a qcow2 channel built an NVMe command"),
        Started::Pending => {
            let fd = channel
                .completion_fd()
                .expect("a pending operation has a completion fd");
            let mut result = None;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while result.is_none() {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, 100) };
                channel.reap(&mut |token, res| {
                    assert_eq!(token, TOKEN, "a completion for a request never made");
                    result = Some(res);
                });
                assert!(
                    std::time::Instant::now() < deadline,
                    "a request never completed"
                );
            }
            result.unwrap_or_default()
        }
    }
}
