//! `preallocation=`: an image mqblk creates, or grows through `export_resize`, gets its space
//! as qemu-img's `-o preallocation=` would give it, checked with QEMU's tools and the file's
//! own blocks: a qcow2 image's clusters all mapped (so a guest's writes never allocate), a
//! file's space reserved or written.
mod support;

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use mqblk_client::Client;
use support::daemon::*;
use support::qemu_img::{assert_checks_clean, qemu_img_ok, read_through_qemu};

const SIZE: u64 = 16 << 20;
const GROWN: u64 = 32 << 20;
const CLUSTER: u64 = 64 << 10;

/// The bytes of `path` the filesystem has given blocks.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// The guest bytes `qemu-img map` shows mapped in the image itself (`data`, depth 0).
fn mapped(img: &Path) -> u64 {
    // `-U`: read while mqblk serves it, which QEMU's locks would refuse.
    let out = qemu_img_ok(&["map", "-U", "--output=json", &img.display().to_string()]);
    let ranges: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    ranges
        .iter()
        .filter(|r| r["data"] == true && r["depth"] == 0)
        .map(|r| r["length"].as_u64().unwrap())
        .sum()
}

/// The bytes of `path` that are data, not holes. ext4 counts space reserved but never
/// written, none of it in the page cache, as a hole, so this tells `full` from `falloc`.
fn written(path: &Path) -> u64 {
    use rustix::fs::{seek, SeekFrom};
    let f = File::open(path).unwrap();
    let end = f.metadata().unwrap().len();
    let (mut at, mut data) = (0, 0);
    while at < end {
        let Ok(start) = seek(&f, SeekFrom::Data(at)) else {
            break;
        };
        at = seek(&f, SeekFrom::Hole(start)).unwrap();
        data += at - start;
    }
    data
}

/// That `img` takes at least `len` bytes of the filesystem exactly when `mode` reserves or
/// writes its space (`falloc`, `full`), and that `full` wrote them (no more than the image's
/// metadata left as holes).
fn assert_space(img: &Path, mode: &str, len: u64, when: &str) {
    let takes_space = mode == "falloc" || mode == "full";
    assert_eq!(
        allocated(img) >= len,
        takes_space,
        "{mode} {when}: {} bytes of the file allocated",
        allocated(img)
    );
    if mode == "full" {
        assert!(
            written(img) >= len,
            "{mode} {when}: zeros written, not reserved"
        );
    }
}

/// `[write_backs, cow_writes]` of export `id`'s metadata path.
fn allocation_counters(api: &mut support::api::Api, id: &str) -> [u64; 2] {
    let got = api.ok("export_get", serde_json::json!({ "id": id }));
    let m = &got["status"]["metadata"];
    let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("no {k}: {got}"));
    [n("write_backs"), n("cow_writes")]
}

/// A qcow2 image mqblk creates with each mode: every cluster mapped from the start (none with
/// `off`, the control), the file's space taken only where the mode says, guest writes served
/// without allocating anything (no write-back, no copy-on-write: with `off` each 4 KiB write
/// into a new cluster is one of each), `qemu-img check` clean, and QEMU reads back what was
/// written. `export_resize` maps the clusters it adds the same way.
#[test]
fn a_qcow2_image_created_with_preallocation_maps_every_cluster_and_no_write_allocates() {
    for mode in ["off", "metadata", "falloc", "full"] {
        let dir = TestDir::new();
        let img = dir.join("disk.qcow2");
        let sock = dir.join("s.sock");
        let export = Export::file(&sock, &img)
            .set("id", "vm")
            .set("format", "qcow2")
            .set("size", &SIZE.to_string())
            .set("preallocation", mode)
            // What it counts: `write`'s group commits (`journal` records instead).
            .set("metadata-commit", "write");
        let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
        let preallocated = mode != "off";
        assert_eq!(
            mapped(&img),
            if preallocated { SIZE } else { 0 },
            "{mode}: guest bytes mapped at creation"
        );
        assert_space(&img, mode, SIZE, "at creation");

        let mut c = Client::connect(&sock, 1).unwrap();
        let mut expected = vec![0u8; GROWN as usize];
        let before = allocation_counters(&mut api, "vm");
        // 4 KiB into each of 16 clusters, one at a time.
        for i in 0..16u64 {
            let at = (3 * i + 1) * CLUSTER + 4096;
            let data = pattern(4096, at, 0x9a);
            c.write(0, at, &data).unwrap();
            expected[at as usize..at as usize + 4096].copy_from_slice(&data);
        }
        let after = allocation_counters(&mut api, "vm");
        let allocations = [after[0] - before[0], after[1] - before[1]];
        let want = if preallocated { [0, 0] } else { [16, 16] };
        assert_eq!(
            allocations, want,
            "{mode}: write-backs and copy-on-writes of 16 writes ({before:?} -> {after:?})"
        );

        let status = api.ok(
            "export_resize",
            serde_json::json!({"id": "vm", "size": GROWN.to_string()}),
        );
        assert_eq!(status["capacity"], GROWN, "{status}");
        let at = GROWN - 4096;
        let data = pattern(4096, at, 0x9b);
        c.write(0, at, &data).unwrap();
        expected[at as usize..].copy_from_slice(&data);
        c.flush(0).unwrap();
        drop(c);
        d.stop();

        assert_checks_clean(&img, false);
        assert_eq!(
            mapped(&img),
            if preallocated { GROWN } else { 17 * CLUSTER },
            "{mode}: guest bytes mapped after the resize"
        );
        let back = read_through_qemu(&img, &dir.join("read.raw"));
        assert_bytes_eq(&back, &expected, 0, &format!("{mode}: read back by QEMU"));
    }
}

/// A raw file mqblk creates with `falloc` or `full` has its space reserved (`full`: written,
/// no hole), `off` leaves it sparse, and `export_resize` grows it the same way; all of it
/// reads as zeros but what the guest wrote.
#[test]
fn a_raw_file_created_with_preallocation_takes_its_space_and_keeps_the_mode_when_grown() {
    for mode in ["off", "falloc", "full"] {
        let dir = TestDir::new();
        let img = dir.join("disk.raw");
        let sock = dir.join("s.sock");
        let export = Export::file(&sock, &img)
            .set("id", "vm")
            .set("size", &SIZE.to_string())
            .set("preallocation", mode);
        let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
        let check_space = |len: u64, when: &str| {
            assert_space(&img, mode, len, when);
            if mode == "full" {
                // A raw file is all data: no byte of it left a hole.
                assert_eq!(written(&img), len, "{mode} {when}: zeros written");
            }
        };
        check_space(SIZE, "at creation");
        let status = api.ok(
            "export_resize",
            serde_json::json!({"id": "vm", "size": GROWN.to_string()}),
        );
        assert_eq!(status["capacity"], GROWN, "{status}");
        check_space(GROWN, "after the resize");
        let mut c = Client::connect(&sock, 1).unwrap();
        let at = GROWN - 8192;
        let data = pattern(4096, at, 0x9c);
        c.write(0, at, &data).unwrap();
        c.flush(0).unwrap();
        drop(c);
        d.stop();
        let mut expected = vec![0u8; GROWN as usize];
        expected[at as usize..at as usize + 4096].copy_from_slice(&data);
        assert_bytes_eq(&std::fs::read(&img).unwrap(), &expected, 0, mode);
    }
}

/// An image that exists keeps the space it has, whatever `preallocation=` says, and the log
/// says so: the key is for images mqblk creates and what it adds to them.
#[test]
fn an_existing_image_keeps_its_space_and_the_log_says_why() {
    let dir = TestDir::new();
    let img = dir.join("disk.raw");
    File::create(&img).unwrap().set_len(SIZE).unwrap();
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img).set("preallocation", "full");
    let mut d = Daemon::start(&dir, &[export]);
    let log = d.log();
    d.stop();
    assert!(
        allocated(&img) < SIZE / 2,
        "{} bytes allocated",
        allocated(&img)
    );
    assert!(
        log.contains(
            "keeps the space it has: preallocation=full applies to an image mqblk creates"
        ),
        "{log}"
    );
}

/// After a runtime snapshot the export writes an overlay, which takes no preallocation (its
/// unallocated clusters show the backing image): `export_resize` then grows it as `off`
/// would, rather than failing on the export's `preallocation=`.
#[test]
fn a_preallocated_export_grows_its_snapshot_overlay_unpreallocated() {
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    let overlay = dir.join("overlay.qcow2");
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img)
        .set("id", "vm")
        .set("format", "qcow2")
        .set("size", &SIZE.to_string())
        .set("preallocation", "metadata");
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    api.ok(
        "export_snapshot",
        serde_json::json!({"id": "vm", "overlay": overlay.display().to_string()}),
    );
    let status = api.ok(
        "export_resize",
        serde_json::json!({"id": "vm", "size": GROWN.to_string()}),
    );
    assert_eq!(status["capacity"], GROWN, "{status}");
    let mut c = Client::connect(&sock, 1).unwrap();
    let at = GROWN - 4096;
    let data = pattern(4096, at, 0x9d);
    c.write(0, at, &data).unwrap();
    c.flush(0).unwrap();
    drop(c);
    d.stop();
    assert_checks_clean(&overlay, false);
    // The overlay maps only the cluster written; the base keeps its clusters mapped.
    assert_eq!(mapped(&overlay), CLUSTER, "the overlay's own clusters");
    assert_eq!(mapped(&img), SIZE, "the base's");
    let back = read_through_qemu(&overlay, &dir.join("read.raw"));
    assert_bytes_eq(
        &back[at as usize..],
        &data,
        at,
        "the write past the old end",
    );
}
