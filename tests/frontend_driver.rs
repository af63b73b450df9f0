//! mqblk-client's own vhost-user frontend (`Driver::Frontend`, the bench's `--client frontend`,
//! the only client SPDK's vhost target accepts) moves the right data: verified workloads on
//! several queues, with interrupts and with polling, against an mqblk export in this process,
//! the image checked byte for byte afterwards; and a read-only export is refused for writes.
mod support;

use mqblk::config::parse_export_spec;
use mqblk::daemon::Export;
use mqblk_client::{self as client, Driver, Pattern};
use support::daemon::{apply_verify, verify_workload, TestDir};

const SIZE: usize = 16 << 20;
const BS: usize = 4096;

/// Serves a 16 MiB zeroed image on `queues` queues and runs a verify workload of `jobs` jobs
/// (`ops` writes each) through the frontend; checks the report and then the image.
fn verify_through_the_frontend(queues: usize, jobs: usize, ops: u64, poll: bool) {
    let dir = TestDir::new();
    let sock = dir.path().join("s.sock");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; SIZE]).unwrap();
    let spec = format!(
        "socket={},path={},queues={queues},direct=off",
        sock.display(),
        img.display()
    );
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    let seed = 0x6672_6f6e_7465 + queues as u64;
    let mut w = verify_workload(&sock, queues, jobs, ops, seed);
    w.driver = Driver::Frontend;
    w.poll = poll;
    let r = client::run(&w).expect("the frontend's run");
    export.shutdown();
    assert_eq!(r.errors, 0, "{r}");
    assert_eq!(r.mismatches, 0, "{r}");
    assert_eq!(r.verified_bytes, jobs as u64 * ops * BS as u64, "{r}");
    let mut expected = vec![0u8; SIZE];
    apply_verify(&mut expected, &r, seed);
    let on_disk = std::fs::read(&img).unwrap();
    let first_diff = on_disk.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "the image differs from what was written");
}

#[test]
fn verified_writes_and_reads_on_one_queue() {
    verify_through_the_frontend(1, 2, 256, false);
}

#[test]
fn verified_writes_and_reads_on_four_queues_with_interrupts() {
    verify_through_the_frontend(4, 4, 256, false);
}

#[test]
fn verified_writes_and_reads_on_two_queues_polled() {
    verify_through_the_frontend(2, 2, 256, true);
}

#[test]
fn a_random_read_run_counts_what_it_did() {
    let dir = TestDir::new();
    let sock = dir.path().join("s.sock");
    let spec = format!("socket={},engine=null,size=64M,queues=2", sock.display());
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    let mut w = client::Workload::new(&sock);
    w.driver = Driver::Frontend;
    w.num_queues = 2;
    w.jobs = 2;
    w.iodepth = 16;
    w.pattern = Pattern::RandRead;
    w.ops_per_job = Some(2000);
    let r = client::run(&w).expect("the frontend's run");
    export.shutdown();
    assert_eq!((r.ios, r.reads, r.errors), (4000, 4000, 0), "{r}");
    assert_eq!(r.bytes, 4000 * 4096, "{r}");
}

#[test]
fn writes_to_a_read_only_export_are_refused() {
    let dir = TestDir::new();
    let sock = dir.path().join("s.sock");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let spec = format!(
        "socket={},path={},readonly=on",
        sock.display(),
        img.display()
    );
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    let mut w = verify_workload(&sock, 1, 1, 8, 1);
    w.driver = Driver::Frontend;
    let e = client::run(&w).expect_err("a write run on a read-only export");
    export.shutdown();
    assert!(format!("{e:#}").contains("read-only"), "{e:#}");
}
