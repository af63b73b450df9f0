//! `mqblk bench` end to end on a tiny configuration: it starts `mqblk serve` itself, drives it
//! with the built-in client, stops it, and writes results.json, report.md and iops.png.
mod support;

use std::path::Path;
use std::process::Command;

use support::daemon::{mqblk_bin, TestDir};

/// Runs `mqblk bench ARGS --out OUT`, which must succeed; returns what it printed.
fn bench_ok(args: &[&str], out: &Path) -> String {
    let o = Command::new(mqblk_bin())
        .arg("bench")
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "bench failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// One short sample of 4 KiB random writes at iodepth 8, on one job, over a 16 MiB image: each
/// allocates clusters in a qcow2 image, so `qemu-img check` after it sees metadata mqblk wrote.
const TINY_RANDWRITE: [&str; 12] = [
    "--workloads",
    "randwrite-4k",
    "--jobs",
    "1",
    "--iodepth",
    "8",
    "--runtime",
    "0.3",
    "--repeat",
    "1",
    "--size",
    "16M",
];

#[test]
fn bench_runs_a_tiny_null_configuration_end_to_end() {
    let dir = TestDir::new();
    let out = dir.path().join("out");
    let stdout = bench_ok(
        &[
            "--backend",
            "mqblk",
            "--engine",
            "null",
            "--mode",
            "per-queue",
            "--workloads",
            "randread-4k",
            "--jobs",
            "1",
            "--iodepth",
            "8",
            "--runtime",
            "0.5",
            "--repeat",
            "1",
            "--size",
            "64M",
        ],
        &out,
    );
    assert!(stdout.contains("mqblk per-queue"), "{stdout}");

    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 1, "{text}");
    let p = &points[0];
    assert_eq!(p["backend"], "mqblk");
    assert_eq!(p["mode"], "per-queue");
    assert_eq!(p["jobs"], 1);
    let s = &p["samples"][0];
    assert!(s["error"].is_null(), "{s}");
    let ios = s["ios"].as_u64().unwrap();
    assert!(ios > 0, "{s}");
    assert!(s["iops"].as_f64().unwrap() > 0.0, "{s}");
    // The backend's own numbers came back: CPU from /proc, counters from --stats-file.
    assert!(s["backend_cpu_s"].as_f64().is_some(), "{s}");
    assert!(s["peak_rss_kib"].as_u64().unwrap() > 0, "{s}");
    let requests = s["mqblk"]["requests"].as_u64().unwrap();
    assert!(
        requests >= ios,
        "backend counted {requests} requests, client {ios}"
    );
    assert!(
        p["summary"]["iops"]["median"].as_f64().unwrap() > 0.0,
        "{p}"
    );

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| mqblk per-queue | 1 |"), "{md}");
    let png = std::fs::read(out.join("iops.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn bench_rejects_bad_arguments_before_running_anything() {
    let dir = TestDir::new();
    let o = Command::new(mqblk_bin())
        .args(["bench", "--mode", "per-thread", "--out"])
        .arg(dir.path().join("out"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("per-thread") && err.contains("per-queue"),
        "{err}"
    );
    assert!(
        !dir.path().join("out").exists(),
        "nothing is written on a usage error"
    );
}

/// `--format qcow2-overlay` with a `format=raw` variant: the bench makes the raw image (and,
/// with `--read-first`, reads it once) and an overlay over it (anew before each sample), mqblk
/// serves the overlay in one series and the raw image in the other, `qemu-img check` finds the
/// overlay consistent after its sample, and results.json records which format each point
/// served. Random writes: each allocates clusters in the overlay, so the check sees the
/// metadata mqblk wrote for them.
#[test]
fn bench_serves_a_qcow2_overlay_and_the_raw_image_side_by_side() {
    let dir = TestDir::new();
    let out = dir.path().join("out");
    let stdout = bench_ok(
        &[
            &[
                "--backend",
                "mqblk",
                "--engine",
                "uring",
                "--read-first",
                "--format",
                "qcow2-overlay",
                "--mode",
                "per-queue",
            ][..],
            &TINY_RANDWRITE,
            &["--mqblk-opts=", "--mqblk-opts", "format=raw"],
        ]
        .concat(),
        &out,
    );
    // --read-first read the raw image (16 MiB) before the first sample.
    assert!(
        stdout.contains(&format!(
            "read {} once (16 MiB",
            out.join("disk.img").display()
        )),
        "{stdout}"
    );
    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["options"]["format"], "qcow2-overlay");
    assert_eq!(v["options"]["read_first"], true);
    let points = v["points"].as_array().unwrap();
    let served: Vec<(&str, &str)> = points
        .iter()
        .map(|p| (p["label"].as_str().unwrap(), p["format"].as_str().unwrap()))
        .collect();
    assert_eq!(
        served,
        [
            ("mqblk per-queue qcow2-overlay", "qcow2-overlay"),
            ("mqblk per-queue raw", "raw")
        ],
        "{text}"
    );
    let log = std::fs::read_to_string(out.join("logs/mqblk.log")).unwrap();
    let overlay = out.join("overlay.qcow2");
    let disk = out.join("disk.img");
    assert!(
        log.contains(&format!(
            "format=qcow2,path={},direct=on",
            overlay.display()
        )) && log.contains(&format!("path={},direct=on", disk.display()))
            && log.contains(&format!("\"-b\" \"{}\"", disk.display())),
        "{log}"
    );
}

/// `--format qcow2-empty`, `qcow2-metadata` and `qcow2-falloc`: both backends serve a new qcow2
/// image of the raw image's size, without a backing file, made anew before each sample (so
/// each sample starts from nothing: no cluster allocated, or every one mapped over a sparse or
/// reserved file), and `qemu-img check` finds it consistent after each.
#[test]
fn bench_serves_new_qcow2_images_made_anew_for_each_backend() {
    for (format, file, preallocation) in [
        ("qcow2-empty", "empty.qcow2", "off"),
        ("qcow2-metadata", "metadata.qcow2", "metadata"),
        ("qcow2-falloc", "falloc.qcow2", "falloc"),
    ] {
        let dir = TestDir::new();
        let out = dir.path().join("out");
        bench_ok(
            &[
                &[
                    "--backend",
                    "mqblk,qsd",
                    "--engine",
                    "uring",
                    "--format",
                    format,
                    "--mode",
                    "mq",
                ][..],
                &TINY_RANDWRITE,
            ]
            .concat(),
            &out,
        );
        let text = std::fs::read_to_string(out.join("results.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["options"]["format"], format);
        let points = v["points"].as_array().unwrap();
        assert_eq!(points.len(), 2, "{text}");
        assert!(points.iter().all(|p| p["format"] == format), "{text}");
        let image = out.join(file);
        for log in ["logs/mqblk.log", "logs/qsd.log"] {
            let log = std::fs::read_to_string(out.join(log)).unwrap();
            // Made anew, 16 MiB, with no backing file, preallocated as the format says.
            let made = format!("\"{}\" \"16777216\"", image.display());
            let options = format!("preallocation={preallocation}\"");
            assert!(
                log.contains(&made) && log.contains(&options) && !log.contains("\"-b\""),
                "{format}: {log}"
            );
        }
    }
}
