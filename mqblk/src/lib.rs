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
//! - [`shm`]: shared memory a frontend cannot truncate from under the daemon (seals, fault
//!   guards);
//! - [`engine`]: storage engines (io_uring on a file or block device, NVMe commands through
//!   io_uring passthrough, RAM, null);
//! - [`blk`]: virtio-blk request parsing and the configuration space (pure);
//! - [`sandbox`]: the daemon's confinement (Landlock, seccomp, io_uring restrictions,
//!   privileges);
//! - [`config`]: export settings and the one table of export keys.
//!
//! Beside the layers, usable by all: `log_limit` (the rate limit on what a guest can make
//! mqblk log) and `test_hooks` (the variables through which tests reach a debug build).
//!
//! docs/ARCHITECTURE.md walks a request through these files.

#![warn(missing_docs)]

pub mod api;
pub mod blk;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod format;
pub mod frontend;
pub mod io;
pub mod log_limit;
pub mod sandbox;
pub mod shm;
pub(crate) mod test_hooks;

#[cfg(test)]
mod layering {
    /// The layers, lowest first: a module may use only the layers listed before it.
    const LAYERS: &[&str] = &[
        "config", "format", "sandbox", "blk", "engine", "shm", "io", "frontend", "api", "daemon",
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

    /// A file's module path below `src` (`io/qos/mod.rs`: `io::qos`).
    fn module_of(src: &std::path::Path, file: &std::path::Path) -> Vec<String> {
        let rel = file.strip_prefix(src).unwrap().with_extension("");
        let mut path: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if path.last().is_some_and(|l| l == "mod" || l == "lib") {
            path.pop();
        }
        path
    }

    /// The modules that the file of module `me` names through `crate::` and `super::` paths
    /// (each path's longest prefix that is a module; in a `{...}` group, each item's).
    fn modules_used(
        me: &[String],
        text: &str,
        modules: &[Vec<String>],
    ) -> std::collections::BTreeSet<Vec<String>> {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let longest = |path: Vec<String>| {
            (1..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| modules.contains(p))
        };
        let mut used = std::collections::BTreeSet::new();
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        for (at, _) in code
            .match_indices("crate::")
            .chain(code.match_indices("super::"))
        {
            if code[..at].ends_with(ident) || code[..at].ends_with("::") {
                continue;
            }
            let mut path: Vec<String> = me.to_vec();
            let mut rest = &code[at..];
            if let Some(r) = rest.strip_prefix("crate::") {
                path.clear();
                rest = r;
            }
            while let Some(r) = rest.strip_prefix("super::") {
                path.pop();
                rest = r;
            }
            loop {
                let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
                if end == 0 {
                    break;
                }
                path.push(rest[..end].to_string());
                match rest[end..].strip_prefix("::") {
                    Some(r) => rest = r,
                    None => break,
                }
            }
            let group = rest.strip_prefix('{').and_then(|r| r.split_once('}'));
            for item in group.map_or("", |(items, _)| items).split(',') {
                let first = item.trim().split("::").next().unwrap_or("");
                let mut p = path.clone();
                p.push(first.to_string());
                used.extend(longest(p));
            }
            used.extend(longest(path));
        }
        used.remove(me);
        used
    }

    /// No two modules use each other, except a module and its own submodules: a reader can
    /// start from either end of every dependency.
    #[test]
    fn no_two_modules_use_each_other() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let modules: Vec<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
        let uses: Vec<_> = files
            .iter()
            .zip(&modules)
            .map(|(f, m)| modules_used(m, &std::fs::read_to_string(f).unwrap(), &modules))
            .collect();
        assert!(
            uses[modules
                .iter()
                .position(|m| m == &["io", "qos", "admit"])
                .unwrap()]
            .contains(&vec!["io".to_string(), "thread".to_string()]),
            "the check sees crate:: paths"
        );
        for (a, used) in modules.iter().zip(&uses) {
            for b in used {
                let nested = a.starts_with(b) || b.starts_with(a);
                let back = uses[modules.iter().position(|m| m == b).unwrap()].contains(a);
                assert!(
                    nested || !back,
                    "{} and {} use each other",
                    a.join("::"),
                    b.join("::")
                );
            }
        }
    }
}
