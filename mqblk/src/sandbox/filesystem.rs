//! Landlock: the files and directories the confined daemon may reach, and what it may do there.
//!
//! Each export needs its image (read, and unless read-only write and truncate; a missing
//! image's directory, to create it) and its socket's directory (make a socket, remove it); the
//! qcow2 metadata journals' directory in the state directory (made at startup, granted whatever
//! the exports: `metadata-commit=auto`, the default, keeps a journal where it can). The
//! API socket's directory likewise; the stats file's directory to create, write and rename the
//! file over its old self; Ceph's conf and keyring, read. `--allow-dir` directories get all of
//! that, for exports the API adds later. Landlock's rules are fixed once applied, so an export
//! the API adds is checked here first ([`Grants::check`]) and refused with a message naming
//! `--allow-dir`.
//!
//! Rights are those of Landlock ABI 5 (file reads, writes, creation and removal, truncation,
//! device ioctls); newer kinds of rights (connecting to unix sockets by path, say) are not
//! handled, so the daemon keeps them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use landlock::{
    make_bitflags, Access, AccessFs, BitFlags, CompatLevel, Compatible, LandlockStatus,
    PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, ABI,
};

use super::{Error, Needs};
use crate::config::qcow2::BackingFormat;
use crate::config::{EngineKind, ExportConfig, ImageFormat};
use crate::format::qcow2;

/// The Landlock ABI whose rights the sandbox handles.
const ABI_HANDLED: ABI = ABI::V5;

/// An image the export reads.
const READ_IMAGE: BitFlags<AccessFs> = make_bitflags!(AccessFs::{ReadFile | IoctlDev});
/// An image the export also writes and resizes.
const WRITE_IMAGE: BitFlags<AccessFs> =
    make_bitflags!(AccessFs::{ReadFile | IoctlDev | WriteFile | Truncate});
/// A directory a socket is bound in (and removed from at shutdown, or when stale).
const SOCKET_DIR: BitFlags<AccessFs> = make_bitflags!(AccessFs::{MakeSock | RemoveFile});
/// The stats file's directory: the file is written beside itself and renamed over the old one.
const STATS_DIR: BitFlags<AccessFs> =
    make_bitflags!(AccessFs::{MakeReg | WriteFile | Truncate | RemoveFile});
/// A file only read (Ceph's conf and keyring).
const READ_ONLY: BitFlags<AccessFs> = make_bitflags!(AccessFs::{ReadFile});
/// An `--allow-dir`: whatever an export may need there.
const ALLOWED_DIR: BitFlags<AccessFs> = make_bitflags!(AccessFs::{
    ReadFile | IoctlDev | WriteFile | Truncate | MakeReg | MakeSock | RemoveFile
});

/// One thing the daemon may reach: a path (absolute, links resolved) and what it may do
/// beneath it.
#[derive(Debug, Clone)]
struct Grant {
    path: PathBuf,
    access: BitFlags<AccessFs>,
    /// What the path is, for messages.
    what: &'static str,
}

/// Everything the daemon may reach.
#[derive(Debug, Clone)]
pub(super) struct Grants {
    grants: Vec<Grant>,
    /// The `--allow-dir` directories, as given (for messages).
    allow_dirs: Vec<PathBuf>,
}

/// How much of the ruleset the kernel enforces.
pub(super) enum Enforced {
    /// All of it.
    Fully,
    /// Not these rights, which the kernel does not know.
    Partly(String),
    /// None of it: why.
    Not(String),
}

/// An export the API would add outside what the sandbox lets the daemon reach.
#[derive(Debug, thiserror::Error)]
#[error(
    "{what} {} lies outside what the sandbox lets mqblk reach: start mqblk serve with \
     --allow-dir naming a directory above it (now: {allowed}), or with --sandbox off",
    path.display()
)]
pub struct PathRefused {
    /// What the path is for.
    pub what: &'static str,
    /// The path.
    pub path: PathBuf,
    /// The `--allow-dir` directories now, as one phrase.
    pub allowed: String,
}

impl Grants {
    /// What `needs` and `allow_dirs` name.
    pub(super) fn new(needs: &Needs, allow_dirs: &[PathBuf]) -> Grants {
        let mut grants: Vec<Grant> = needs.exports.iter().flat_map(export_grants).collect();
        if let Some(api) = needs.api_socket {
            grants.extend(in_directory(api, SOCKET_DIR, "the API socket's directory"));
        }
        if let Some(stats) = needs.stats_file {
            grants.extend(in_directory(stats, STATS_DIR, "the stats file's directory"));
        }
        for dir in allow_dirs {
            match dir.canonicalize() {
                Ok(path) => grants.push(Grant {
                    path,
                    access: ALLOWED_DIR,
                    what: "--allow-dir",
                }),
                Err(e) => tracing::warn!(dir = %dir.display(), err = %e, "--allow-dir: ignored"),
            }
        }
        grants.extend(runtime_grants());
        let journals = journal_grant();
        if journals.path.is_dir() {
            grants.push(journals);
        }
        Grants {
            grants,
            allow_dirs: allow_dirs.to_vec(),
        }
    }

    /// Applies the rules to the calling thread (and the threads it starts from now on).
    pub(super) fn restrict_self(&self) -> Result<Enforced, Error> {
        let landlock = |e: landlock::RulesetError| Error::Landlock(e.to_string());
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(ABI_HANDLED))
            .map_err(landlock)?
            .create()
            .map_err(landlock)?;
        for g in &self.grants {
            let Ok(fd) = PathFd::new(&g.path) else {
                // Gone since it was looked at: what needed it fails with its own error.
                continue;
            };
            let is_dir = std::fs::metadata(&g.path).is_ok_and(|m| m.is_dir());
            let access = if is_dir {
                g.access
            } else {
                g.access & AccessFs::from_file(ABI_HANDLED)
            };
            tracing::debug!(path = %g.path.display(), ?access, what = g.what, "Landlock rule");
            ruleset = ruleset
                .add_rule(PathBeneath::new(fd, access))
                .map_err(landlock)?;
        }
        let status = ruleset.restrict_self().map_err(landlock)?;
        Ok(match (status.ruleset, status.landlock) {
            (RulesetStatus::FullyEnforced, _) => Enforced::Fully,
            (RulesetStatus::PartiallyEnforced, LandlockStatus::Available { effective_abi, .. }) => {
                let lacking = AccessFs::from_all(ABI_HANDLED) & !AccessFs::from_all(effective_abi);
                let mut names = String::new();
                for right in lacking.iter() {
                    let _ = write!(
                        names,
                        "{}{right:?}",
                        if names.is_empty() { "" } else { ", " }
                    );
                }
                Enforced::Partly(names)
            }
            (RulesetStatus::PartiallyEnforced, _) => Enforced::Partly("some rights".into()),
            (RulesetStatus::NotEnforced, LandlockStatus::NotEnabled) => {
                Enforced::Not("not enabled in this kernel: add landlock to its lsm= list".into())
            }
            (RulesetStatus::NotEnforced, _) => {
                Enforced::Not("not built into this kernel (Linux 5.13 or later has it)".into())
            }
        })
    }

    /// Whether everything `cfg` would open is reachable; if not, the first thing that is not.
    pub(super) fn check(&self, cfg: &ExportConfig) -> Result<(), PathRefused> {
        for need in export_grants(cfg) {
            let covered = self
                .grants
                .iter()
                .any(|g| need.path.starts_with(&g.path) && (need.access & !g.access).is_empty());
            if !covered {
                let allowed = if self.allow_dirs.is_empty() {
                    "none".to_string()
                } else {
                    let dirs = self.allow_dirs.iter().map(|d| d.display().to_string());
                    dirs.collect::<Vec<_>>().join(", ")
                };
                return Err(PathRefused {
                    what: need.what,
                    path: need.path,
                    allowed,
                });
            }
        }
        Ok(())
    }
}

/// What one export reaches.
fn export_grants(cfg: &ExportConfig) -> Vec<Grant> {
    let mut out = Vec::new();
    if cfg.fd.is_none() && !cfg.socket.as_os_str().is_empty() {
        out.extend(in_directory(
            &cfg.socket,
            SOCKET_DIR,
            "the export's socket directory",
        ));
    }
    match cfg.engine {
        // An NVMe character device is granted as an image: read, write, and its ioctls.
        EngineKind::Uring | EngineKind::Nvme => {
            let Some(image) = &cfg.path else {
                return out;
            };
            let access = if cfg.readonly {
                READ_IMAGE
            } else {
                WRITE_IMAGE
            };
            match image.canonicalize() {
                Ok(path) => out.push(Grant {
                    path,
                    access,
                    what: "the export's image",
                }),
                // Missing: its directory, where mqblk creates it (size=), or reports it
                // missing.
                Err(_) => out.extend(in_directory(
                    image,
                    access | AccessFs::MakeReg,
                    "the directory of the export's image",
                )),
            }
            if cfg.format == ImageFormat::Qcow2 {
                out.extend(backing_grants(cfg, image));
                if cfg.needs_qcow2_journal() {
                    out.push(journal_grant());
                }
            }
        }
        EngineKind::Rbd => {
            for (file, what) in [
                (&cfg.rbd.conf, "the export's Ceph conf"),
                (&cfg.rbd.keyring, "the export's Ceph keyring"),
            ] {
                if let Some(file) = file {
                    out.push(Grant {
                        path: file.canonicalize().unwrap_or_else(|_| file.clone()),
                        access: READ_ONLY,
                        what,
                    });
                }
            }
        }
        EngineKind::Null | EngineKind::Mem => {}
    }
    out
}

/// The directory of the qcow2 metadata journals (in the state directory, which `mqblk serve`
/// makes before the sandbox closes the filesystem): journals made, read and written there.
/// Granted whatever the exports given at startup are, so that an export the API adds with
/// `metadata-commit=auto` (the default) keeps a journal too; one with `journal` needs it.
fn journal_grant() -> Grant {
    let dir = crate::config::state_dir::qcow2_journals_root();
    Grant {
        path: dir.canonicalize().unwrap_or(dir),
        access: WRITE_IMAGE | AccessFs::MakeReg,
        what: "the directory of the qcow2 metadata journals (in --state-dir)",
    }
}

/// Read access to every image under the qcow2 image `image`: its backing chain as recorded,
/// or, for an overlay mqblk is to create, the chain of `backing=`. A chain that cannot be
/// resolved grants nothing (opening the export then fails with what is wrong with it).
fn backing_grants(cfg: &ExportConfig, image: &Path) -> Vec<Grant> {
    let paths = |top: &Path, skip: usize| -> Vec<PathBuf> {
        qcow2::header::reachable(top)
            .into_iter()
            .skip(skip)
            .map(|l| l.path)
            .collect()
    };
    let layers = if image.exists() {
        paths(image, 1)
    } else {
        match (&cfg.qcow2.backing, cfg.qcow2.backing_format) {
            (Some(name), Some(format)) => {
                let path = image.parent().unwrap_or(Path::new(".")).join(name);
                match format {
                    BackingFormat::Raw => vec![path],
                    BackingFormat::Qcow2 => paths(&path, 0),
                }
            }
            _ => Vec::new(),
        }
    };
    layers
        .into_iter()
        .filter_map(|l| l.canonicalize().ok())
        .map(|path| Grant {
            path,
            access: READ_ONLY,
            what: "a backing image of the export's image",
        })
        .collect()
}

/// `access` in the directory holding `path` (absolute, links resolved); nothing if that
/// directory does not exist (what needs it then fails with its own error).
fn in_directory(path: &Path, access: BitFlags<AccessFs>, what: &'static str) -> Option<Grant> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = parent.canonicalize().ok()?;
    Some(Grant {
        path: dir,
        access,
        what,
    })
}

/// What the daemon reaches whatever its configuration: with the rbd engine built in,
/// librados's default conf and keyring directory, and the time zone its log lines are stamped
/// in (measured: the rbd tests under strace; nothing else librados opens once connected).
fn runtime_grants() -> Vec<Grant> {
    let mut out = Vec::new();
    if crate::config::rbd::BUILT {
        for (path, what) in [
            ("/etc/ceph", "librados's default conf and keyring directory"),
            ("/etc/localtime", "the time zone of librados's log"),
        ] {
            out.push(Grant {
                path: PathBuf::from(path),
                access: READ_ONLY | AccessFs::ReadDir,
                what,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_export_spec;

    fn needs(exports: &[ExportConfig]) -> Needs<'_> {
        Needs {
            exports,
            api_socket: None,
            stats_file: None,
            tcp_server: false,
        }
    }

    /// A temporary directory with `a/disk.img` and `b/other` in it; `a` and `b`.
    fn two_dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("disk.img"), b"image").unwrap();
        std::fs::write(b.join("other"), b"other").unwrap();
        (tmp, a, b)
    }

    #[test]
    fn the_kernel_enforces_the_rules() {
        let (_tmp, a, b) = two_dirs();
        let image = a.join("disk.img");
        let spec = format!(
            "socket={},path={}",
            a.join("s.sock").display(),
            image.display()
        );
        let exports = [parse_export_spec(&spec).unwrap()];
        let grants = Grants::new(&needs(&exports), &[]);
        // Landlock confines the calling thread and its children only: a thread of its own.
        let (a2, b2) = (a.clone(), b.clone());
        std::thread::spawn(move || {
            match grants.restrict_self().unwrap() {
                Enforced::Fully => {}
                Enforced::Partly(lacking) => eprintln!("Landlock lacks {lacking}"),
                Enforced::Not(why) => panic!("this test needs Landlock: {why}"),
            }
            let denied = |r: std::io::Result<std::fs::File>, what: &str| {
                let e = r.err().unwrap_or_else(|| panic!("{what} was allowed"));
                assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{what}: {e}");
            };
            // The image: read and written.
            let rw = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&image);
            rw.expect("the image opens read-write");
            // Anything else: refused, beside it or elsewhere.
            denied(std::fs::File::open(b2.join("other")), "reading elsewhere");
            denied(
                std::fs::File::create(a2.join("new.img")),
                "creating beside the image",
            );
            denied(std::fs::File::open("/etc/hostname"), "reading /etc");
            // Its socket directory: a socket is made and removed.
            let sock = a2.join("s.sock");
            drop(std::os::unix::net::UnixListener::bind(&sock).expect("binding the socket"));
            std::fs::remove_file(&sock).expect("removing the socket");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn exports_outside_the_grants_are_refused_by_name() {
        let (_tmp, a, b) = two_dirs();
        let spec = |dir: &Path, img: &str| {
            format!(
                "socket={},path={}",
                dir.join("s.sock").display(),
                dir.join(img).display()
            )
        };
        let started = [parse_export_spec(&spec(&a, "disk.img")).unwrap()];
        let grants = Grants::new(&needs(&started), &[]);
        // The startup export itself, and another on its socket directory with its image.
        grants.check(&started[0]).unwrap();
        // An image elsewhere, even beside the socket: refused, naming the rule.
        let e = grants
            .check(&parse_export_spec(&spec(&a, "other.img")).unwrap())
            .unwrap_err();
        assert!(e.path.ends_with("a"), "{e}");
        assert!(e.to_string().contains("--allow-dir"), "{e}");
        let e = grants
            .check(&parse_export_spec(&spec(&b, "disk.img")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("(now: none)"), "{e}");
        // With --allow-dir b, anything beneath b.
        let grants = Grants::new(&needs(&started), std::slice::from_ref(&b));
        grants
            .check(&parse_export_spec(&spec(&b, "new.img")).unwrap())
            .unwrap();
        // A read-only grant does not cover writing.
        let ro = [parse_export_spec(&format!("{},readonly=on", spec(&a, "disk.img"))).unwrap()];
        let grants = Grants::new(&needs(&ro), &[]);
        grants.check(&ro[0]).unwrap();
        assert!(grants.check(&started[0]).is_err());
    }
}
