//! Reading a qcow2 header before the image is opened, and walking its backing chain.
//!
//! imago opens images itself; this file exists so that an image mqblk must not serve is refused
//! with one line an operator can act on, before any library touches it: an image left dirty or
//! marked corrupt names the `qemu-img check -r all` that repairs it, a feature mqblk cannot
//! serve is named, and a backing chain that is missing a file or loops is described link by
//! link. The layout is `docs/interop/qcow2.txt` in QEMU (all fields big-endian).

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::{Qcow2Error, IMAGO_CACHED_L2_TABLES, MAX_CHAIN};
use crate::config::qcow2::BackingFormat;

/// "QFI\xfb".
pub const MAGIC: u32 = 0x5146_49fb;

/// Header extension: the backing file's format name.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Header extension: the end of the extensions.
const EXT_END: u32 = 0;

/// Where a version 3 header keeps its incompatible feature bits (a big-endian u64).
pub const INCOMPATIBLE_FEATURES_AT: u64 = 72;

/// Where a version 3 header keeps its autoclear feature bits (a big-endian u64).
pub const AUTOCLEAR_FEATURES_AT: u64 = 88;

/// The autoclear bit mqblk sets on an image it serves with `metadata-commit=journal`: a dirty
/// mark found with it set is that daemon's, which its journal covers. The qcow2 spec reserves
/// autoclear bits 2-63 and asks every writer that does not know one to clear it before it
/// writes the image, as QEMU does (`qemu-img check -r`, a guest's QEMU), so an image another
/// program has written since (and may have marked dirty itself) has it clear, and its mark is
/// not taken for the journal's. imago would clear it too, by writing the whole header when it
/// opens an image: reads of the header through mqblk's storage hide it from imago
/// (`engine::qcow2::storage`).
pub const JOURNAL_OWNS_MARK: u64 = 1 << 63;

/// The header's byte that holds [`JOURNAL_OWNS_MARK`] (the field's first: it is big-endian),
/// and the bit within it.
pub const JOURNAL_OWNS_MARK_BYTE: (u64, u8) = (AUTOCLEAR_FEATURES_AT, 1 << 7);

/// The incompatible feature bits and what each means for mqblk. A served image has none set,
/// so a writer that marks it dirty (`metadata-commit=flush`) knows the whole field.
pub const DIRTY: u32 = 0;
const CORRUPT: u32 = 1;

/// The byte of the header that holds the dirty bit (the field's last: it is big-endian).
pub const DIRTY_BYTE: u64 = INCOMPATIBLE_FEATURES_AT + 7;

/// Whether incompatible feature bits `bits` (as the header stores them) say dirty.
pub fn dirty_in(bits: [u8; 8]) -> bool {
    u64::from_be_bytes(bits) & (1 << DIRTY) != 0
}

/// Clears the dirty bit of a version 3 header read from an image this process serves: there
/// it is the process's own mark (`metadata-commit=flush`), not a sign of a crash.
pub fn unmark_dirty(head: &mut [u8]) {
    let at = DIRTY_BYTE as usize;
    if head.len() > at && be32(head, 4) == 3 {
        head[at] &= !(1 << DIRTY);
    }
}

/// Whether a head read from an image carries the dirty bit and nothing that an opening
/// library would write back into the header (autoclear feature bits other than
/// [`JOURNAL_OWNS_MARK`], which imago clears on a writable open by writing the whole header,
/// the dirty bit with it).
pub fn marked_dirty_alone(head: &[u8]) -> bool {
    head.len() >= 104
        && be32(head, 4) == 3
        && be64(head, INCOMPATIBLE_FEATURES_AT as usize) == 1 << DIRTY
        && be64(head, AUTOCLEAR_FEATURES_AT as usize) & !JOURNAL_OWNS_MARK == 0
}

/// Whether a head read from an image is marked dirty by a daemon serving it with
/// `metadata-commit=journal`: the dirty bit alone ([`marked_dirty_alone`]), and the journal's
/// autoclear bit ([`journal_owns_mark`]).
pub fn marked_by_journal(head: &[u8]) -> bool {
    marked_dirty_alone(head) && journal_owns_mark(head)
}

/// Whether a head read from an image says that its dirty mark, if any, is that of a daemon
/// serving it with `metadata-commit=journal` (see [`JOURNAL_OWNS_MARK`]).
pub fn journal_owns_mark(head: &[u8]) -> bool {
    head.len() >= 104
        && be32(head, 4) == 3
        && be64(head, AUTOCLEAR_FEATURES_AT as usize) & JOURNAL_OWNS_MARK != 0
}

/// Names of the incompatible features this file knows but mqblk does not serve.
const UNSERVED: &[(u32, &str)] = &[
    (2, "external data file"),
    (3, "compression type other than zlib"),
    (4, "extended L2 entries (subclusters)"),
];

/// How much of an image's start is read: the header and its extensions fit in its first
/// cluster, which is at least 512 bytes; a longer backing name is read on its own.
pub const HEAD_BYTES: usize = 64 << 10;

/// The largest L1 table served (QEMU's `QCOW_MAX_L1_SIZE`).
const MAX_L1_BYTES: u64 = 32 << 20;

/// The largest refcount table served (QEMU's `QCOW_MAX_REFTABLE_SIZE`).
const MAX_REFTABLE_BYTES: u64 = 8 << 20;

/// What mqblk needs from a qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// The backing file as recorded, if there is one.
    pub backing: Option<String>,
    /// The backing format as recorded (the header extension), if it is.
    pub backing_format: Option<String>,
    /// Where the L1 table is (a file offset).
    pub l1_offset: u64,
    /// Its entries.
    pub l1_entries: u32,
    /// Internal snapshots.
    pub snapshots: u32,
    /// Where the refcount table is (a file offset).
    pub reftable_offset: u64,
    /// Its length in clusters.
    pub reftable_clusters: u32,
    /// log2 of a refcount's width in bits (4, 16-bit refcounts, in version 2).
    pub refcount_order: u32,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The offset bits of an L1 or refcount table entry (the rest are flags, or reserved).
const TABLE_ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;

/// The file offsets an L1 or refcount table's bytes hold, entry by entry (0: none).
pub fn table_entries(table: &[u8]) -> impl Iterator<Item = u64> + '_ {
    table
        .chunks_exact(8)
        .map(|e| be64(e, 0) & TABLE_ENTRY_OFFSET)
}

/// An image's header and the bytes of its L1 and refcount tables, as read at one time.
pub struct Tables<'a> {
    /// The header, which says where the tables are.
    pub header: &'a Header,
    /// The L1 table's `l1_entries` entries.
    pub l1: &'a [u8],
    /// The refcount table's `reftable_clusters` clusters.
    pub reftable: &'a [u8],
}

/// Whether `head` (an image's first bytes) starts with the qcow2 magic.
pub fn is_qcow2(head: &[u8]) -> bool {
    head.len() >= 4 && be32(head, 0) == MAGIC
}

/// Parses the header in `head` (the image's first bytes) of the image `path` (for messages),
/// refusing what mqblk does not serve.
pub fn parse(path: &Path, head: &[u8]) -> Result<Header, Qcow2Error> {
    let bad = |why: String| Qcow2Error::BadHeader {
        path: path.display().to_string(),
        why,
    };
    if head.len() < 72 || !is_qcow2(head) {
        return Err(bad("it does not start with a qcow2 header".into()));
    }
    let version = be32(head, 4);
    if version != 2 && version != 3 {
        return Err(bad(format!("qcow2 version {version} (2 and 3 are served)")));
    }
    let cluster_bits = be32(head, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(bad(format!(
            "cluster_bits {cluster_bits} is outside 9..=21"
        )));
    }
    if be32(head, 32) != 0 {
        return Err(Qcow2Error::Encrypted(path.display().to_string()));
    }
    // What the tables may be, as QEMU bounds them (`qcow2_validate_table`): mqblk reads both
    // before imago does, and computes with their ends.
    let cluster = 1u64 << cluster_bits;
    let fits = |offset: u64, bytes: u64, max: u64| {
        offset.is_multiple_of(cluster) && bytes <= max && offset <= i64::MAX as u64 - bytes
    };
    let (l1_offset, l1_entries) = (be64(head, 40), be32(head, 36));
    if !fits(l1_offset, u64::from(l1_entries) * 8, MAX_L1_BYTES) {
        return Err(bad(format!(
            "an L1 table of {l1_entries} entries at {l1_offset} (cluster-aligned, at most {} \
             entries, ending within a file)",
            MAX_L1_BYTES / 8
        )));
    }
    // An L1 table too small to map the whole disk is one QEMU refuses to open ("L1 table is too
    // small"); imago would grow it, up to 32 MiB, at the guest's first write past its end.
    let size = be64(head, 24);
    let needed = size.div_ceil(1 << (2 * cluster_bits - 3));
    if needed > u64::from(l1_entries) {
        return Err(bad(format!(
            "L1 table entries {l1_entries}, where a disk of {size} bytes needs {needed} \
             (QEMU refuses it too: \"L1 table is too small\")"
        )));
    }
    let (reftable_offset, reftable_clusters) = (be64(head, 48), be32(head, 56));
    if !fits(
        reftable_offset,
        u64::from(reftable_clusters) * cluster,
        MAX_REFTABLE_BYTES,
    ) {
        return Err(bad(format!(
            "a refcount table of {reftable_clusters} clusters at {reftable_offset} \
             (cluster-aligned, at most {MAX_REFTABLE_BYTES} bytes, ending within a file)"
        )));
    }
    let mut ext_start = 72usize;
    if version == 3 {
        if head.len() < 104 {
            return Err(bad("the version 3 header is cut short".into()));
        }
        check_incompatible(path, be64(head, 72))?;
        let order = be32(head, 96);
        if order > 6 {
            return Err(bad(format!("refcount_order {order} is outside 0..=6")));
        }
        let header_length = be32(head, 100) as usize;
        if header_length < 104 || header_length > head.len() {
            return Err(bad(format!("header_length {header_length}")));
        }
        ext_start = header_length.next_multiple_of(8);
    }
    let backing_offset = be64(head, 8);
    let backing_len = be32(head, 16) as usize;
    let backing = if backing_offset == 0 {
        None
    } else {
        let start = usize::try_from(backing_offset)
            .ok()
            .filter(|&s| backing_len <= 1023 && s.saturating_add(backing_len) <= head.len())
            .ok_or_else(|| {
                bad(format!(
                    "backing file name at {backing_offset}, {backing_len} bytes"
                ))
            })?;
        let name = std::str::from_utf8(&head[start..start + backing_len])
            .map_err(|_| bad("the backing file name is not UTF-8".into()))?;
        Some(name.to_string())
    };
    Ok(Header {
        version,
        cluster_bits,
        size,
        backing,
        backing_format: backing_format_ext(head, ext_start),
        l1_offset,
        l1_entries,
        snapshots: be32(head, 60),
        reftable_offset,
        reftable_clusters,
        refcount_order: if version == 3 { be32(head, 96) } else { 4 },
    })
}

/// Refuses an image whose incompatible feature bits mqblk cannot honour.
fn check_incompatible(path: &Path, bits: u64) -> Result<(), Qcow2Error> {
    let shown = || path.display().to_string();
    if bits & (1 << CORRUPT) != 0 {
        return Err(Qcow2Error::Corrupt(shown()));
    }
    if bits & (1 << DIRTY) != 0 {
        return Err(Qcow2Error::Dirty(shown()));
    }
    for bit in 2..64 {
        if bits & (1 << bit) == 0 {
            continue;
        }
        let feature = UNSERVED.iter().find(|(b, _)| *b == bit).map_or_else(
            || format!("unknown incompatible feature bit {bit}"),
            |(_, n)| (*n).into(),
        );
        return Err(Qcow2Error::Unserved {
            path: shown(),
            feature,
        });
    }
    Ok(())
}

/// The backing format extension's value, if the extensions from `at` hold one.
fn backing_format_ext(head: &[u8], mut at: usize) -> Option<String> {
    while at + 8 <= head.len() {
        let (kind, len) = (be32(head, at), be32(head, at + 4) as usize);
        let data = head.get(at + 8..at + 8 + len)?;
        match kind {
            EXT_END => return None,
            EXT_BACKING_FORMAT => return std::str::from_utf8(data).ok().map(str::to_string),
            _ => at += 8 + len.next_multiple_of(8),
        }
    }
    None
}

/// Reads up to [`HEAD_BYTES`] from the start of `path`.
pub fn read_head(path: &Path) -> Result<Vec<u8>, Qcow2Error> {
    let io = |what, err| Qcow2Error::Io {
        what,
        path: path.display().to_string(),
        err,
    };
    let f = File::open(path).map_err(|e| io("cannot open", e))?;
    let mut head = Vec::with_capacity(HEAD_BYTES);
    f.take(HEAD_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(|e| io("cannot read", e))?;
    Ok(head)
}

/// One image of a chain, from the top (the served image) down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// Where it is, as opened.
    pub path: PathBuf,
    /// Its format.
    pub format: BackingFormat,
    /// What its tables could take in imago's memory: its L1 table and
    /// [`IMAGO_CACHED_L2_TABLES`] of its clusters (0 for a raw image, or where the chain could
    /// not be followed this far).
    pub tables: u64,
}

/// What the tables of a chain's images could take in imago's memory together.
pub fn tables_bytes(layers: &[Layer]) -> u64 {
    layers.iter().map(|l| l.tables).sum()
}

/// The chain under the qcow2 image `top`, `top` first: each backing file resolved as QEMU does
/// (a relative name is relative to the directory of the image that records it), each format
/// as recorded or, where an old image records none, by the magic (as QEMU probes it then).
/// A missing backing file, a name that is not a plain path, a loop, a chain of more than
/// [`MAX_CHAIN`] images and one whose tables could take more than `table_memory_max` bytes in
/// imago (each image's L1 table and [`IMAGO_CACHED_L2_TABLES`] of its clusters) are refused.
/// With `top_marked_live`, the top's dirty bit is another live server's mark (see
/// `engine::qcow2::dirty_mark`), not a crash's, and is let through.
pub fn chain(
    top: &Path,
    table_memory_max: u64,
    top_marked_live: bool,
) -> Result<Vec<Layer>, Qcow2Error> {
    let mut layers = Vec::new();
    walk(top, table_memory_max, top_marked_live, &mut layers).map(|()| layers)
}

/// The images of the chain under `top` (`top` first) as far as it can be followed: what a
/// sandbox must let the daemon read for [`chain`] to say what is wrong with the rest.
pub fn reachable(top: &Path) -> Vec<Layer> {
    let mut layers = Vec::new();
    let _ = walk(top, u64::MAX, true, &mut layers);
    layers
}

/// Follows the chain under `top`, appending each image to `layers`, until its end or the first
/// image that cannot be followed.
fn walk(
    top: &Path,
    table_memory_max: u64,
    top_marked_live: bool,
    layers: &mut Vec<Layer>,
) -> Result<(), Qcow2Error> {
    layers.push(Layer {
        path: top.to_path_buf(),
        format: BackingFormat::Qcow2,
        tables: 0,
    });
    let mut seen = HashSet::new();
    seen.insert(canonical(top)?);
    let mut tables_bytes = 0u64;
    let mut at_top = true;
    loop {
        let current = layers.last_mut().expect("the top is there");
        if current.format == BackingFormat::Raw {
            return Ok(());
        }
        let mut head = read_head(&current.path)?;
        if top_marked_live && at_top {
            unmark_dirty(&mut head);
        }
        at_top = false;
        let header = parse(&current.path, &head)?;
        current.tables =
            8 * u64::from(header.l1_entries) + (IMAGO_CACHED_L2_TABLES << header.cluster_bits);
        tables_bytes += current.tables;
        let current = current.path.clone();
        if tables_bytes > table_memory_max {
            return Err(Qcow2Error::ChainTablesTooLarge {
                image: top.display().to_string(),
                mib: tables_bytes.div_ceil(1 << 20),
                max_mib: table_memory_max >> 20,
            });
        }
        let Some(name) = header.backing else {
            return Ok(());
        };
        let image = current.display().to_string();
        if name.contains(':') && !Path::new(&name).exists() {
            return Err(Qcow2Error::BackingNotAPath {
                image,
                backing: name,
            });
        }
        let path = match Path::new(&name) {
            p if p.is_absolute() => p.to_path_buf(),
            p => current.parent().unwrap_or(Path::new(".")).join(p),
        };
        if !path.exists() {
            return Err(Qcow2Error::MissingBacking {
                image,
                backing: path.display().to_string(),
            });
        }
        if layers.len() == MAX_CHAIN {
            return Err(Qcow2Error::ChainTooDeep(top.display().to_string()));
        }
        if !seen.insert(canonical(&path)?) {
            let mut links: Vec<String> = layers
                .iter()
                .map(|l| l.path.display().to_string())
                .collect();
            links.push(path.display().to_string());
            return Err(Qcow2Error::BackingLoop(links.join(" -> ")));
        }
        let format = match header.backing_format.as_deref() {
            Some("raw") => BackingFormat::Raw,
            Some("qcow2") => BackingFormat::Qcow2,
            Some(other) => {
                return Err(Qcow2Error::BackingFormat {
                    image,
                    format: other.to_string(),
                })
            }
            None if is_qcow2(&read_head(&path)?) => BackingFormat::Qcow2,
            None => BackingFormat::Raw,
        };
        layers.push(Layer {
            path,
            format,
            tables: 0,
        });
    }
}

fn canonical(path: &Path) -> Result<PathBuf, Qcow2Error> {
    path.canonicalize().map_err(|err| Qcow2Error::Io {
        what: "cannot resolve",
        path: path.display().to_string(),
        err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::qcow2::DEFAULT_TABLE_MEMORY_MAX;

    #[test]
    fn a_mark_is_the_journals_only_with_its_autoclear_bit_and_no_other() {
        let mut h = v3(1 << 30, 1 << DIRTY, None);
        assert!(marked_dirty_alone(&h) && !journal_owns_mark(&h));
        let at = AUTOCLEAR_FEATURES_AT as usize;
        h[at..at + 8].copy_from_slice(&JOURNAL_OWNS_MARK.to_be_bytes());
        assert!(marked_dirty_alone(&h) && journal_owns_mark(&h) && marked_by_journal(&h));
        assert_eq!(
            h[JOURNAL_OWNS_MARK_BYTE.0 as usize], JOURNAL_OWNS_MARK_BYTE.1,
            "the byte storage hides"
        );
        // Another autoclear bit: imago would write the whole header, dirty bit and all.
        h[at + 7] = 1;
        assert!(!marked_dirty_alone(&h) && journal_owns_mark(&h) && !marked_by_journal(&h));
    }

    /// A version 3 header of `size` bytes with 64 KiB clusters, `incompat` bits, and an
    /// optional backing file (name, format extension).
    fn v3(size: u64, incompat: u64, backing: Option<(&str, Option<&str>)>) -> Vec<u8> {
        let mut h = vec![0u8; 4096];
        h[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&size.to_be_bytes());
        // An L1 table that maps the whole disk (each entry 512 MiB at 64 KiB clusters).
        h[36..40].copy_from_slice(&(size.div_ceil(512 << 20) as u32).to_be_bytes());
        h[72..80].copy_from_slice(&incompat.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&104u32.to_be_bytes());
        let mut at = 104;
        if let Some((name, format)) = backing {
            if let Some(f) = format {
                h[at..at + 4].copy_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
                h[at + 4..at + 8].copy_from_slice(&(f.len() as u32).to_be_bytes());
                h[at + 8..at + 8 + f.len()].copy_from_slice(f.as_bytes());
                at += 8 + f.len().next_multiple_of(8);
            }
            at += 8; // the end extension (zeroes)
            h[8..16].copy_from_slice(&(at as u64).to_be_bytes());
            h[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
            h[at..at + name.len()].copy_from_slice(name.as_bytes());
        }
        h
    }

    #[test]
    fn a_plain_header_parses() {
        let h = parse(
            Path::new("a.qcow2"),
            &v3(1 << 30, 0, Some(("b.raw", Some("raw")))),
        )
        .unwrap();
        assert_eq!(
            h,
            Header {
                version: 3,
                cluster_bits: 16,
                size: 1 << 30,
                backing: Some("b.raw".into()),
                backing_format: Some("raw".into()),
                l1_offset: 0,
                l1_entries: 2,
                snapshots: 0,
                reftable_offset: 0,
                reftable_clusters: 0,
                refcount_order: 4,
            }
        );
        let h = parse(Path::new("a.qcow2"), &v3(4096, 0, None)).unwrap();
        assert_eq!((h.backing, h.backing_format), (None, None));
    }

    /// QEMU's rule: the L1 table maps the whole disk.
    #[test]
    fn an_l1_table_too_small_for_the_disk_is_refused() {
        let p = Path::new("a.qcow2");
        let mut h = v3(1 << 30, 0, None);
        h[36..40].copy_from_slice(&1u32.to_be_bytes());
        let e = parse(p, &h).unwrap_err().to_string();
        assert!(
            e.contains("L1 table entries 1, where a disk of 1073741824 bytes needs 2"),
            "{e}"
        );
        // Just enough, and more than enough, are fine.
        for entries in [2u32, 3] {
            h[36..40].copy_from_slice(&entries.to_be_bytes());
            assert!(parse(p, &h).is_ok());
        }
    }

    #[test]
    fn tables_out_of_bounds_or_unaligned_are_refused() {
        let p = Path::new("a.qcow2");
        for (at, value) in [
            (36, (4u64 << 20) + 1), // L1 entries: one past 32 MiB
            (40, 4096),             // L1 offset: not cluster-aligned
            (48, 512),              // refcount table offset
            (56, 129),              // refcount table clusters: past 8 MiB
            (40, !0xffff),          // L1 offset: its end past any file
            (48, !0xffff),          // refcount table offset: the same
        ] {
            let mut h = v3(1 << 30, 0, None);
            match at {
                36 | 56 => h[at..at + 4].copy_from_slice(&(value as u32).to_be_bytes()),
                _ => h[at..at + 8].copy_from_slice(&value.to_be_bytes()),
            }
            let e = parse(p, &h).unwrap_err().to_string();
            assert!(e.contains("table of"), "field at {at}: {e}");
        }
    }

    #[test]
    fn flags_are_refused_with_the_repair_to_run() {
        let p = Path::new("/img/a.qcow2");
        let e = parse(p, &v3(4096, 1, None)).unwrap_err().to_string();
        assert!(
            e.contains("dirty") && e.contains("qemu-img check -r all /img/a.qcow2"),
            "{e}"
        );
        let e = parse(p, &v3(4096, 2, None)).unwrap_err().to_string();
        assert!(
            e.contains("corrupt") && e.contains("qemu-img check -r all"),
            "{e}"
        );
        let e = parse(p, &v3(4096, 1 << 4, None)).unwrap_err().to_string();
        assert!(e.contains("extended L2"), "{e}");
        let e = parse(p, &v3(4096, 1 << 40, None)).unwrap_err().to_string();
        assert!(e.contains("unknown incompatible feature bit 40"), "{e}");
        let mut enc = v3(4096, 0, None);
        enc[35] = 1;
        let e = parse(p, &enc).unwrap_err().to_string();
        assert!(e.contains("encrypted"), "{e}");
        let e = parse(
            p,
            b"not a qcow2 image at all, just some bytes in a raw file.......................",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("does not start with a qcow2 header"), "{e}");
    }

    /// `count` qcow2 headers in `d`: `{prefix}i.qcow2` over `{prefix}(i - 1).qcow2`, the first
    /// over a raw `0.raw` (written here), each changed by `patch` after [`v3`] made it.
    fn write_chain(d: &Path, prefix: &str, count: usize, patch: impl Fn(&mut [u8])) {
        std::fs::write(d.join("0.raw"), vec![0u8; 4096]).unwrap();
        for i in 1..=count {
            let below = match i - 1 {
                0 => ("0.raw".to_string(), "raw"),
                b => (format!("{prefix}{b}.qcow2"), "qcow2"),
            };
            let mut header = v3(4096, 0, Some((below.0.as_str(), Some(below.1))));
            patch(&mut header);
            std::fs::write(d.join(format!("{prefix}{i}.qcow2")), header).unwrap();
        }
    }

    #[test]
    fn a_chain_of_more_than_max_chain_images_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write_chain(d, "", MAX_CHAIN, |_| ());
        let deepest = d.join(format!("{}.qcow2", MAX_CHAIN - 1));
        assert_eq!(
            chain(&deepest, DEFAULT_TABLE_MEMORY_MAX, false)
                .unwrap()
                .len(),
            MAX_CHAIN
        );
        let too_deep = d.join(format!("{MAX_CHAIN}.qcow2"));
        let e = chain(&too_deep, DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&too_deep.display().to_string())
                && e.contains(&format!("more than {MAX_CHAIN} images"))
                && e.contains("qemu-img commit"),
            "{e}"
        );
    }

    #[test]
    fn a_chain_whose_tables_could_take_more_than_the_bound_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // 2 MiB clusters (256 MiB of L2 tables each) with the smallest L1 table: seven fit in
        // 2 GiB, eight do not.
        write_chain(d, "", 8, |h| {
            h[20..24].copy_from_slice(&21u32.to_be_bytes())
        });
        assert_eq!(
            chain(&d.join("7.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false)
                .unwrap()
                .len(),
            8
        );
        let top = d.join("8.qcow2");
        let e = chain(&top, DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&top.display().to_string())
                && e.contains("2049 MiB")
                && e.contains("more than table-memory-max=2048M")
                && e.contains("qemu-img commit"),
            "{e}"
        );
        // 64 tiny images each declaring the largest L1 table (32 MiB) over 64 KiB clusters.
        write_chain(d, "l", 64, |h| {
            h[36..40].copy_from_slice(&(4u32 << 20).to_be_bytes())
        });
        assert!(chain(&d.join("l51.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false).is_ok());
        let e = chain(&d.join("l52.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2080 MiB"), "{e}");
        // The bound is the export's: half of it refuses the fourth 2 MiB-cluster image.
        assert_eq!(chain(&d.join("3.qcow2"), 1 << 30, false).unwrap().len(), 4);
        let e = chain(&d.join("4.qcow2"), 1 << 30, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than table-memory-max=1024M"), "{e}");
    }

    #[test]
    fn chains_resolve_relative_names_and_refuse_loops_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("base.raw"), vec![0u8; 4096]).unwrap();
        std::fs::write(
            d.join("mid.qcow2"),
            v3(4096, 0, Some(("base.raw", Some("raw")))),
        )
        .unwrap();
        // No format recorded: probed by magic, as QEMU does for old images.
        std::fs::write(d.join("top.qcow2"), v3(4096, 0, Some(("mid.qcow2", None)))).unwrap();
        let c = chain(&d.join("top.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false).unwrap();
        let formats: Vec<_> = c.iter().map(|l| l.format).collect();
        assert_eq!(
            formats,
            [
                BackingFormat::Qcow2,
                BackingFormat::Qcow2,
                BackingFormat::Raw
            ]
        );
        assert_eq!(c[2].path, d.join("base.raw"));

        std::fs::write(
            d.join("hole.qcow2"),
            v3(4096, 0, Some(("gone.raw", Some("raw")))),
        )
        .unwrap();
        let e = chain(&d.join("hole.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gone.raw") && e.contains("does not exist"),
            "{e}"
        );

        std::fs::write(
            d.join("x.qcow2"),
            v3(4096, 0, Some(("y.qcow2", Some("qcow2")))),
        )
        .unwrap();
        std::fs::write(
            d.join("y.qcow2"),
            v3(4096, 0, Some(("x.qcow2", Some("qcow2")))),
        )
        .unwrap();
        let e = chain(&d.join("x.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("loops") && e.contains("x.qcow2 -> ") && e.contains("y.qcow2"),
            "{e}"
        );

        std::fs::write(
            d.join("vmdk.qcow2"),
            v3(4096, 0, Some(("base.raw", Some("vmdk")))),
        )
        .unwrap();
        let e = chain(&d.join("vmdk.qcow2"), DEFAULT_TABLE_MEMORY_MAX, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vmdk"), "{e}");
    }
}
