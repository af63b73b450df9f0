//! mqblk: a multi-queue vhost-user-blk backend.
//!
//! A VMM or libblkio program connects to an export's unix socket and shares guest memory;
//! mqblk serves the guest's virtqueues straight from that memory to host storage, one I/O
//! thread (with its own io_uring) per queue or group of queues, with no lock shared between
//! them on the request path.
//!
//! The layers, each depending only on those listed after it:
//! - [`daemon`]: exports, sockets, signals, the stats file;
//! - [`api`]: what operators' tools talk to: export status, management API, metrics;
//! - [`frontend`]: the vhost-user session and the virtio-blk device;
//! - [`io`]: the I/O threads and the request path;
//! - [`engine`]: storage engines (io_uring on a file or block device, RAM, null);
//! - [`blk`]: virtio-blk request parsing and the configuration space (pure);
//! - [`sandbox`]: the daemon's confinement (Landlock, seccomp, io_uring restrictions,
//!   privileges);
//! - [`config`]: export settings and the one table of export keys.
//!
//! docs/ARCHITECTURE.md walks a request through these files.

#![warn(missing_docs)]

pub mod api;
pub mod blk;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod frontend;
pub mod io;
pub mod sandbox;

#[cfg(test)]
mod layering {
    /// The layers, lowest first: a module may use only the layers listed before it.
    const LAYERS: &[&str] = &[
        "config", "sandbox", "blk", "engine", "io", "frontend", "api", "daemon",
    ];

    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn no_module_uses_a_layer_above_it() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        for (rank, layer) in LAYERS.iter().enumerate() {
            let mut files = Vec::new();
            let dir = src.join(layer);
            if dir.is_dir() {
                sources(&dir, &mut files);
            }
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap();
                for above in &LAYERS[rank + 1..] {
                    assert!(
                        !text.contains(&format!("crate::{above}")),
                        "{} ({layer}) uses crate::{above}, a layer above it",
                        f.display()
                    );
                }
            }
        }
    }
}
