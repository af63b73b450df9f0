//! The one table of export keys.
//!
//! Everything that names an export key is generated from this table ([`keys`]): the `--export` and TOML
//! parsers, the unknown-key message, `mqblk serve --help` ([`spec_help`]), and the README's key
//! table, which a test holds to [`readme_rows`]. Adding a key means adding one entry here,
//! written with the helper for its kind of value (`on_off_key!`, `int_key!`, `choice_key!`,
//! ...; `key!` for any other); a QoS limit is one `limit_keys!` line, named in `config::qos`.

use std::path::PathBuf;

use super::preallocation::Preallocation;
use super::qcow2::{self, BackingFormat, ImageFormat, MetadataCommit};
use super::qos::{limit_key, Bucket, Limit, QosConfig, MAX_BURST_LENGTH, MAX_RATE};
use super::rbd;
use super::tuning::PollMode;
use super::values::{parse_bool, parse_cpu_list, parse_size};
use super::{EngineKind, ExportConfig, Threads, MAX_QUEUES, MAX_SERIAL_LEN};

/// One export key.
pub struct Key {
    /// The name, as written in `key=value` and in TOML.
    pub name: &'static str,
    /// The form of its value, as shown in the help (`PATH`, `on|off`, ...).
    pub value: &'static str,
    /// What it does, and its default: one line of the help and of the README.
    pub help: &'static str,
    /// What the error message says the key accepts.
    pub allowed: &'static str,
    /// Applies a value; `None` when the value is not one the key accepts.
    apply: fn(&mut ExportConfig, &str) -> Option<()>,
    /// The value an export has, as `apply` takes it; `None` when it is unset.
    show: fn(&ExportConfig) -> Option<String>,
}

impl Key {
    /// Applies `value` to `cfg`; `None` when the key does not accept it.
    pub fn apply(&self, cfg: &mut ExportConfig, value: &str) -> Option<()> {
        (self.apply)(cfg, value)
    }

    /// The value `cfg` has for this key, in the form [`Key::apply`] takes.
    pub fn show(&self, cfg: &ExportConfig) -> Option<String> {
        (self.show)(cfg)
    }
}

/// Every key `cfg` sets to something other than its default, with its value: what recreates
/// `cfg` through [`ExportConfig::from_pairs`].
pub fn pairs(cfg: &ExportConfig) -> Vec<(&'static str, String)> {
    let default = ExportConfig::default();
    keys()
        .filter_map(|k| {
            let v = k.show(cfg)?;
            (Some(&v) != k.show(&default).as_ref()).then_some((k.name, v))
        })
        .collect()
}

/// An integer in `lo..=hi`.
fn int(v: &str, lo: u64, hi: u64) -> Option<u64> {
    v.parse::<u64>().ok().filter(|n| (lo..=hi).contains(n))
}

/// An id or group name: 1 to 64 letters, digits, '-', '_' or '.'.
fn valid_name(v: &str) -> bool {
    (1..=64).contains(&v.len())
        && v.chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
}

/// `v` if `valid` accepts it.
fn name(v: &str, valid: fn(&str) -> bool) -> Option<String> {
    valid(v).then(|| v.to_string())
}

/// A path that librados can take: without NUL bytes (empty: none).
fn c_path(v: &str) -> Option<Option<PathBuf>> {
    (!v.contains('\0')).then(|| Some(PathBuf::from(v)).filter(|_| !v.is_empty()))
}

/// The export's QoS settings, created by its first QoS key.
fn qos(c: &mut ExportConfig) -> &mut QosConfig {
    c.qos.get_or_insert_with(QosConfig::default)
}

/// A byte rate: a size with optional suffix, at most [`MAX_RATE`].
fn bytes_rate(v: &str) -> Option<u64> {
    parse_size(v).filter(|n| *n <= MAX_RATE)
}

/// A request rate: an integer, at most [`MAX_RATE`].
fn requests_rate(v: &str) -> Option<u64> {
    int(v, 0, MAX_RATE)
}

/// A field of one of the export's QoS limits, unless it has the default `unset`.
fn show_limit(
    c: &ExportConfig,
    bucket: Bucket,
    field: fn(&Limit) -> u64,
    unset: u64,
) -> Option<String> {
    let n = field(c.qos.as_ref()?.limit(bucket));
    (n != unset).then(|| n.to_string())
}

/// A key: `parse` turns a value into what it sets, the place `set` (`None`: the value is
/// refused); `show` gives the value an export has (`None`: unset).
macro_rules! key {
    ($name:expr, $value:expr, |$c:ident| $set:expr => $parse:expr, $show:expr, $allowed:expr, $help:expr $(,)?) => {
        Key {
            name: $name,
            value: $value,
            help: $help,
            allowed: $allowed,
            apply: |$c, v| {
                $set = $parse(v)?;
                Some(())
            },
            show: $show,
        }
    };
}

/// A key of the field `field` (a path of [`ExportConfig`] fields, e.g. `rbd.user`), which
/// `show` shows.
macro_rules! field_key {
    ($name:literal, $value:expr, $($field:ident).+, $parse:expr, $show:expr, $allowed:expr, $help:literal $(,)?) => {
        key!(
            $name,
            $value,
            |c| c.$($field).+ => $parse,
            |c| $show(&c.$($field).+),
            $allowed,
            $help
        )
    };
}

/// An on/off key of the `bool` field `field`.
macro_rules! on_off_key {
    ($name:literal, $($field:ident).+, $help:literal $(,)?) => {
        field_key!(
            $name,
            "on|off",
            $($field).+,
            parse_bool,
            |b: &bool| Some(if *b { "on" } else { "off" }.to_string()),
            "on or off",
            $help
        )
    };
}

/// An integer key of the field `field` (of type `ty`), from `lo` to `hi`.
macro_rules! int_key {
    ($name:literal, $value:literal, $($field:ident).+ as $ty:ty, $lo:expr, $hi:expr, $allowed:literal, $help:literal $(,)?) => {
        field_key!(
            $name,
            $value,
            $($field).+,
            |v| int(v, $lo, $hi).map(|n| n as $ty),
            |n: &$ty| Some(n.to_string()),
            $allowed,
            $help
        )
    };
}

/// A key whose values name an enum's variants: each `"value" => Variant` written once, for
/// parsing and showing both.
macro_rules! choice_key {
    ($name:literal, $($field:ident).+, $ty:ident { $v0:literal => $variant0:ident $(, $v:literal => $variant:ident)* $(,)? }, $allowed:literal, $help:literal $(,)?) => {
        field_key!(
            $name,
            concat!($v0 $(, "|", $v)*),
            $($field).+,
            |v| match v {
                $v0 => Some($ty::$variant0),
                $($v => Some($ty::$variant),)*
                _ => None,
            },
            |x: &$ty| Some(match x {
                $ty::$variant0 => $v0,
                $($ty::$variant => $v,)*
            }.to_string()),
            $allowed,
            $help
        )
    };
}

/// A key naming an RBD pool, image or namespace (optional: `None` until given).
macro_rules! rbd_name_key {
    ($name:literal, $field:ident, $help:literal $(,)?) => {
        field_key!(
            $name,
            "NAME",
            rbd.$field,
            |v| name(v, rbd::valid_name).map(Some),
            |n: &Option<String>| n.clone(),
            "a non-empty name of at most 255 characters without '/', '@', ',' or '='",
            $help
        )
    };
}

/// A key of a path librados reads (optional: `None` until given).
macro_rules! rbd_path_key {
    ($name:literal, $field:ident, $help:literal $(,)?) => {
        field_key!(
            $name,
            "PATH",
            rbd.$field,
            c_path,
            |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string()),
            "a path without NUL bytes (librados takes C strings)",
            $help
        )
    };
}

const IOPS: &str = "an integer from 0 to 1000000000000000 (requests per second; 0: no limit)";
const BPS: &str =
    "bytes per second from 0 to 1000000000000000, with optional K/M/G/T suffix (0: no limit)";
const NAME: &str = "1 to 64 letters, digits, '-', '_' or '.'";

/// Every key but the QoS keys, in the order the help and the README list them.
const GENERAL: &[Key] = &[
    field_key!(
        "id",
        "NAME",
        id,
        |v| name(v, valid_name),
        |id: &String| Some(id.clone()),
        NAME,
        "the export's name in the management API, the stats and the metrics, and the `FileDescriptorName=` of its socket under systemd socket activation (default: the socket's file name without its extension)",
    ),
    field_key!(
        "socket",
        "PATH",
        socket,
        |v: &str| Some(PathBuf::from(v)).filter(|_| !v.is_empty()),
        |p: &PathBuf| Some(p.display().to_string()).filter(|s| !s.is_empty()),
        "a path",
        "vhost-user unix socket to listen on (this or `fd=` is required)",
    ),
    field_key!(
        "fd",
        "N",
        fd,
        |v| int(v, 0, i32::MAX as u64).map(|n| Some(n as i32)),
        |fd: &Option<i32>| fd.map(|n| n.to_string()),
        "a file descriptor number from 0 to 2147483647",
        "serve the listening unix socket inherited as file descriptor N instead of binding a path (like qemu-storage-daemon's `addr.type=fd`); it is left open, never unlinked, at exit (default id: `fd-N`)",
    ),
    field_key!(
        "path",
        "PATH",
        path,
        |v: &str| Some(Some(PathBuf::from(v)).filter(|_| !v.is_empty())),
        |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string()),
        "a path",
        "raw image file or block device, or a qcow2 image with `format=qcow2` (engine=uring; with `size=` it is created if missing), or an NVMe namespace's character device /dev/ngXnY (engine=nvme)",
    ),
    choice_key!(
        "engine",
        engine,
        EngineKind { "uring" => Uring, "null" => Null, "mem" => Mem, "rbd" => Rbd, "nvme" => Nvme },
        "uring, null, mem, rbd or nvme",
        "`uring`: io_uring on `path` (default); `null`: completes at once, reads give zeros (the null_blk analogue, measures the backend itself); `mem`: RAM disk; `rbd`: a Ceph RBD image through librbd (`pool`, `image`; a build with the `rbd` feature); `nvme`: NVMe commands straight to the namespace's character device `path=/dev/ngXnY` through io_uring passthrough, skipping the host block layer",
    ),
    choice_key!(
        "format",
        format,
        ImageFormat { "raw" => Raw, "qcow2" => Qcow2 },
        "raw or qcow2",
        "how `path` is laid out: `raw` (default; never probed, so a raw image that starts like a qcow2 header stays raw) or `qcow2` (v2 or v3, with backing chains of raw or qcow2 images; engine=uring)",
    ),
    field_key!(
        "backing",
        "PATH",
        qcow2.backing,
        |v: &str| Some(Some(PathBuf::from(v)).filter(|_| !v.is_empty())),
        |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string()),
        "a path",
        "format=qcow2: create a missing `path` as an overlay over this existing image (recorded as given: a relative path is relative to the overlay's directory); needs `backing-format`",
    ),
    field_key!(
        "backing-format",
        "raw|qcow2",
        qcow2.backing_format,
        |v| match v {
            "raw" => Some(Some(BackingFormat::Raw)),
            "qcow2" => Some(Some(BackingFormat::Qcow2)),
            _ => None,
        },
        |f: &Option<BackingFormat>| f.map(|f| f.name().to_string()),
        "raw or qcow2",
        "format=qcow2: the format of `backing` (required with it; never guessed)",
    ),
    field_key!(
        "cluster-size",
        "BYTES",
        qcow2.cluster_size,
        |v| parse_size(v).filter(|n| qcow2::valid_cluster_size(*n)).map(|n| n as u32),
        |n: &u32| Some(n.to_string()),
        "a power of two from 512 to 2M, with optional K/M suffix",
        "format=qcow2: the cluster size of an image mqblk creates (default 64K, as qemu-img's)",
    ),
    field_key!(
        "l2-cache-size",
        "BYTES",
        qcow2.l2_cache_size,
        |v| parse_size(v).filter(|n| (8..=qcow2::MAX_L2_CACHE_SIZE).contains(n)),
        |n: &u64| Some(n.to_string()),
        "from 8 bytes to 1G, with optional K/M/G suffix",
        "format=qcow2: cluster mapping each I/O thread keeps, in QEMU's measure (8 bytes per cluster; default 4M, which covers 32 GiB at 64 KiB clusters); requests on clusters it does not hold take the slower metadata path",
    ),
    field_key!(
        "table-memory-max",
        "BYTES",
        qcow2.table_memory_max,
        |v| parse_size(v).filter(|n| {
            (qcow2::TABLE_MEMORY_MAX_RANGE.0..=qcow2::TABLE_MEMORY_MAX_RANGE.1).contains(n)
        }),
        |n: &u64| Some(n.to_string()),
        "from 16M to 1T, with optional K/M/G/T suffix",
        "format=qcow2: the most memory the tables of the image and its backing chain may take in imago (each image's L1 table, and 128 of its clusters of L2 tables: 8 MiB an image at 64 KiB clusters, 256 MiB at 2 MiB); a chain that could take more is refused at start (default 2G)",
    ),
    choice_key!(
        "metadata-commit",
        qcow2.metadata_commit,
        MetadataCommit { "auto" => Auto, "write" => Write, "flush" => Flush, "journal" => Journal },
        "auto, write, flush or journal",
        "format=qcow2: when a write into a new cluster has its mapping written to the image file: `journal` at the guest's next flush, with each new mapping recorded before its write completes in a journal in the state directory (--state-dir), which mqblk replays when it serves the image again after its crash, so that none is lost (after a power loss the image holds its last flush); `write` before the write completes, which keeps the same promise (a guest that reconnects after a crash finds every acknowledged write) at a write-back per group of allocating writes; `auto` (default) `journal` where it can be kept (a qcow2 v3 image, a writable state directory), else `write`; `flush` at the guest's next flush, as QEMU does, with no journal (a crash loses the writes into new clusters since the last flush, and the image, marked dirty meanwhile, is then refused until `qemu-img check -r all`); flush and journal need a qcow2 v3 image",
    ),
    choice_key!(
        "preallocation",
        preallocation,
        Preallocation { "off" => Off, "metadata" => Metadata, "falloc" => Falloc, "full" => Full },
        "off, metadata, falloc or full",
        "engine=uring: how the space of an image mqblk creates (`size=` on a missing `path`) or grows (`export_resize`) is provided, as qemu-img's `-o preallocation=`: `off` (default) sparse; `metadata` (format=qcow2) every cluster mapped at once, so no write allocates; `falloc` that and the file's space reserved; `full` that and zeros written over it; an overlay takes only `off`",
    ),
    rbd_name_key!(
        "pool",
        pool,
        "engine=rbd: the RADOS pool holding the image (required)",
    ),
    rbd_name_key!(
        "image",
        image,
        "engine=rbd: the RBD image (required); with `size=` it is created if missing",
    ),
    rbd_name_key!(
        "namespace",
        namespace,
        "engine=rbd: the RADOS namespace within the pool (default: the pool's default namespace)",
    ),
    rbd_path_key!(
        "conf",
        conf,
        "engine=rbd: the ceph.conf naming the monitors (default: librados's search, /etc/ceph/ceph.conf first)",
    ),
    field_key!(
        "user",
        "NAME",
        rbd.user,
        |v| name(v, valid_name),
        |user: &String| Some(user.clone()),
        "a Ceph client name: 1 to 64 letters, digits, '-', '_' or '.'",
        "engine=rbd: the Ceph client name without `client.` (default admin, as in QEMU's rbd driver)",
    ),
    rbd_path_key!(
        "keyring",
        keyring,
        "engine=rbd: the keyring holding the user's key (default: the one ceph.conf names, else /etc/ceph/ceph.client.USER.keyring)",
    ),
    int_key!(
        "timeout",
        "SECONDS",
        rbd.timeout_s as u32,
        1,
        3600,
        "an integer from 1 to 3600 (seconds)",
        "engine=rbd: longest wait for the cluster: connecting at start, and each request, which then fails with an I/O error (default 30)",
    ),
    field_key!(
        "size",
        "BYTES",
        size,
        |v| Some(Some(parse_size(v).filter(|n| *n > 0 && n % 512 == 0)?)),
        |n: &Option<u64>| n.map(|n| n.to_string()),
        "a positive multiple of 512 bytes, with optional K/M/G/T suffix",
        "capacity, K/M/G/T suffixes (needed for null and mem; must match an existing image; creates a missing file or RBD image)",
    ),
    int_key!(
        "queues",
        "N",
        queues as u16,
        1,
        u64::from(MAX_QUEUES),
        "an integer from 1 to 64",
        "virtqueues offered to the guest (default 1, max 64)",
    ),
    field_key!(
        "queue-size",
        "N",
        queue_size,
        |v| int(v, 2, 32768).filter(|n| n.is_power_of_two()).map(|n| n as u16),
        |n: &u16| Some(n.to_string()),
        "a power of two from 2 to 32768",
        "maximum virtqueue size (default 1024)",
    ),
    field_key!(
        "threads",
        "per-queue|N",
        threads,
        |v| match v {
            "per-queue" => Some(Threads::PerQueue),
            n => Some(Threads::Count(int(n, 1, u64::from(MAX_QUEUES))? as u16)),
        },
        |t: &Threads| Some(match t {
            Threads::PerQueue => "per-queue".into(),
            Threads::Count(n) => n.to_string(),
        }),
        "per-queue, or a thread count from 1 to 64",
        "I/O threads: one per queue (default), or N threads with queue q on thread q mod N",
    ),
    field_key!(
        "cpus",
        "LIST",
        cpus,
        |v| parse_cpu_list(v).filter(|l| !l.is_empty()),
        |l: &Vec<usize>| {
            let list: Vec<String> = l.iter().map(|n| n.to_string()).collect();
            (!list.is_empty()).then(|| list.join(":"))
        },
        "a CPU list such as 0-3,8, with CPU numbers below 1024 (1024 CPUs at most)",
        "pin I/O thread i to the i-th CPU of LIST, e.g. `2-5,8`",
    ),
    on_off_key!(
        "readonly",
        readonly,
        "default off; advertises `VIRTIO_BLK_F_RO` and refuses writes",
    ),
    on_off_key!(
        "direct",
        direct,
        "O_DIRECT (default on; if the filesystem refuses it, mqblk says so: pass `direct=off`); with engine=rbd, on turns librbd's cache off (as QEMU's `cache.direct=on` does) and off turns it on",
    ),
    on_off_key!(
        "read-zeroes",
        read_zeroes,
        "engine=null only: a read fills the buffers with zeroes (default on); off leaves them as they were, as QEMU's null-co with `read-zeroes=off` and SPDK's null bdev do, so that a benchmark against those measures the same work",
    ),
    field_key!(
        "serial",
        "STRING",
        serial,
        |v: &str| (v.len() <= MAX_SERIAL_LEN).then(|| v.to_string()),
        |s: &String| Some(s.clone()),
        "at most 20 bytes",
        "answer to GET_ID (at most 20 bytes)",
    ),
    choice_key!(
        "poll",
        tuning.poll,
        PollMode { "off" => Off, "on" => On, "adaptive" => Adaptive },
        "off, on or adaptive",
        "busy-poll the rings while busy, guest notifications suppressed (default adaptive: polls while polls find work, and every 0.5 s compares what it serves polling and sleeping, 5 ms each, and sleeps once two comparisons in a row find sleeping serves 95% as much, as it can where a wake-up is cheap, and polls again once two in a row find polling serves 125% as much; `on` always polls, for the lowest latency whatever the CPU; off suits CPUs shared by more busy threads than they have)",
    ),
    int_key!(
        "poll-max-us",
        "N",
        tuning.poll_max_us as u32,
        0,
        10_000,
        "an integer from 0 to 10000 (microseconds)",
        "longest poll window (default 32; 0 turns polling off)",
    ),
    int_key!(
        "poll-engine-us",
        "N",
        tuning.poll_engine_us as u32,
        0,
        10_000,
        "an integer from 0 to 10000 (microseconds)",
        "while 1 to 4 requests are at the engine, a poll goes on past its window for up to N µs to catch their completions, as SPDK's reactor would, rather than sleep and be woken by them (default 200; where under half such waits see work come, they rest for 256 polls, twice as long each time that repeats, up to 8192; 0: the window alone)",
    ),
    int_key!(
        "batch-wait-us",
        "N",
        tuning.batch_wait_us as u32,
        0,
        1000,
        "an integer from 0 to 1000 (microseconds; 0 disables)",
        "under heavy load, wait up to N µs to grow a batch before the submit (default 0: off)",
    ),
    on_off_key!(
        "merge",
        tuning.merge,
        "merge adjacent requests of one queue into one host I/O (default on)",
    ),
    on_off_key!(
        "fixed-files",
        tuning.fixed_files,
        "register the backing file with each I/O thread's io_uring, so no I/O takes a reference on the shared file (default on)",
    ),
    on_off_key!(
        "fixed-buffers",
        tuning.fixed_buffers,
        "register guest memory as io_uring fixed buffers: single-segment I/O skips per-I/O page pinning; pins all guest memory while connected (default off)",
    ),
    int_key!(
        "sqpoll-idle-ms",
        "N",
        tuning.sqpoll_idle_ms as u32,
        0,
        10_000,
        "an integer from 0 to 10000 (milliseconds; 0 disables SQPOLL)",
        "one kernel submission-polling thread per I/O thread (`IORING_SETUP_SQPOLL`), idle after N ms (default 0: off; costs a CPU while busy)",
    ),
    on_off_key!(
        "coop-taskrun",
        tuning.coop_taskrun,
        "set up each io_uring with `COOP_TASKRUN`, `TASKRUN_FLAG` and `SINGLE_ISSUER`: a completion never interrupts a running I/O thread (no IPI), it is posted at the thread's next syscall (default on; older kernels fall back silently)",
    ),
    on_off_key!(
        "submit-early",
        tuning.submit_early,
        "hand a batch's first I/Os to the kernel while the rest is still being parsed, as long as the device holds fewer than are queued (slow start: 1, 1, 2, 4... per syscall), so that an idle device never waits for the whole batch (default on; off: one syscall per batch)",
    ),
    on_off_key!(
        "notify-early",
        tuning.notify_early,
        "notify the guest at a batch's first completion, so that its wake-up overlaps the rest of the batch, while the I/O thread has its CPU to itself (no more than 50 involuntary context switches in the last 10 ms); with EVENT_IDX only (default on; off: once, after the batch)",
    ),
];

/// A key of the field `field` of the QoS limit `bucket`, shown unless it is `unset`.
macro_rules! limit_field_key {
    ($bucket:ident . $field:ident, $name:expr, $value:expr, $parse:expr, $unset:literal, $allowed:expr, $help:expr) => {
        key!(
            $name,
            $value,
            |c| qos(c).limit_mut(Bucket::$bucket).$field => $parse,
            |c| show_limit(c, Bucket::$bucket, |l| l.$field, $unset),
            $allowed,
            $help
        )
    };
}

/// The three keys of one QoS limit (named by [`Bucket::keys`]): its rate, its burst rate and
/// its burst length.
macro_rules! limit_keys {
    ($bucket:ident, $value:literal, $allowed:expr, $parse:ident, $unit:literal, $help:literal) => {
        [
            limit_field_key!(
                $bucket.rate,
                Bucket::$bucket.keys().0,
                $value,
                $parse,
                0,
                $allowed,
                concat!("QoS: ", $help, " (QEMU's throttling; default 0: no limit)")
            ),
            limit_field_key!(
                $bucket.max,
                Bucket::$bucket.keys().1,
                $value,
                $parse,
                0,
                $allowed,
                concat!(
                    "QoS: burst rate of `",
                    limit_key!($bucket),
                    "`, in ",
                    $unit,
                    " per second (default: none, which lets a tenth of a second's worth come at once)"
                )
            ),
            limit_field_key!(
                $bucket.max_length,
                Bucket::$bucket.keys().2,
                "SECONDS",
                |v| int(v, 1, MAX_BURST_LENGTH),
                1,
                "an integer from 1 to 1000000000 (seconds)",
                concat!(
                    "QoS: how many seconds a burst at `",
                    limit_key!($bucket),
                    "-max` may last (default 1, at which the burst may come at once)"
                )
            ),
        ]
    };
}

/// The keys of the six QoS limits, in the order of [`Bucket::ALL`].
const QOS_LIMITS: [[Key; 3]; 6] = [
    limit_keys!(
        IopsTotal,
        "N",
        IOPS,
        requests_rate,
        "requests",
        "an average of at most N requests per second, reads and writes together"
    ),
    limit_keys!(
        IopsRead,
        "N",
        IOPS,
        requests_rate,
        "requests",
        "an average of at most N read requests per second"
    ),
    limit_keys!(
        IopsWrite,
        "N",
        IOPS,
        requests_rate,
        "requests",
        "an average of at most N write requests per second, write-zeroes included"
    ),
    limit_keys!(
        BpsTotal,
        "BYTES",
        BPS,
        bytes_rate,
        "bytes",
        "an average of at most BYTES per second read and written together, K/M/G/T suffixes"
    ),
    limit_keys!(
        BpsRead,
        "BYTES",
        BPS,
        bytes_rate,
        "bytes",
        "an average of at most BYTES read per second, K/M/G/T suffixes"
    ),
    limit_keys!(
        BpsWrite,
        "BYTES",
        BPS,
        bytes_rate,
        "bytes",
        "an average of at most BYTES written per second, write-zeroes included, K/M/G/T suffixes"
    ),
];

/// The QoS keys beside the limits.
const QOS_SHARED: &[Key] = &[
    key!(
        "iops-size",
        "BYTES",
        |c| qos(c).iops_size => |v| parse_size(v).filter(|n| *n <= 1 << 30),
        |c| c.qos.as_ref().map(|q| q.iops_size).filter(|&n| n > 0).map(|n| n.to_string()),
        "a number of bytes up to 1G, with optional K/M/G suffix (0: every request counts as one)",
        "QoS: a request larger than BYTES counts as its size / BYTES requests in the iops limits (default 0: every request counts as one)",
    ),
    key!(
        "group",
        "NAME",
        |c| qos(c).group => |v| name(v, valid_name).map(Some),
        |c| c.qos.as_ref().and_then(|q| q.group.clone()),
        NAME,
        "QoS: share the limits, and the budget they allow, with every export of the same throttle group (the exports give the same limits, or only one gives them; default: none)",
    ),
];

/// Every export key, in the order the help and the README list them.
pub fn keys() -> impl Iterator<Item = &'static Key> {
    GENERAL
        .iter()
        .chain(QOS_LIMITS.iter().flatten())
        .chain(QOS_SHARED)
}

/// Whether `name` is one of the QoS keys (the limits, `iops-size`, `group`).
pub fn is_qos_key(name: &str) -> bool {
    QOS_LIMITS
        .iter()
        .flatten()
        .chain(QOS_SHARED)
        .any(|k| k.name == name)
}

/// The key called `name`.
pub fn key(name: &str) -> Option<&'static Key> {
    keys().find(|k| k.name == name)
}

/// The names of all keys, comma-separated (for the unknown-key message).
pub fn names() -> String {
    keys().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// `mqblk serve --help`'s description of SPEC.
pub fn spec_help() -> String {
    const WIDTH: usize = 100;
    const COL: usize = 25;
    let mut out = String::from("SPEC is key=value pairs separated by commas:\n");
    for k in keys() {
        let head = format!("  {}={}", k.name, k.value);
        let help = k.help.replace('`', "");
        let mut line = if head.len() + 1 < COL {
            format!("{head:COL$}")
        } else {
            out.push_str(&head);
            out.push('\n');
            " ".repeat(COL)
        };
        for word in help.split(' ') {
            if line.len() + word.len() + 1 > WIDTH && !line.trim().is_empty() {
                out.push_str(line.trim_end());
                out.push('\n');
                line = " ".repeat(COL);
            }
            line.push_str(word);
            line.push(' ');
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out.push_str(
        "\nThread mappings: queues=1,threads=1 is baseline; queues=N,threads=1 is mq;\n\
         queues=N,threads=per-queue is per-queue (one I/O thread and io_uring per queue).\n\
         The TOML config file carries the same keys, one [[export]] table per disk.",
    );
    out
}

/// The README's key table rows, one per key: `` | `name=VALUE` | help | ``.
pub fn readme_rows() -> Vec<String> {
    keys()
        .map(|k| {
            format!(
                "| `{}={}` | {} |",
                k.name,
                k.value.replace('|', "\\|"),
                k.help
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limits_keys_set_that_limit() {
        for b in Bucket::ALL {
            let (rate, max, len) = b.keys();
            let mut c = ExportConfig::default();
            for (k, v) in [(rate, "5"), (max, "6"), (len, "7")] {
                key(k).unwrap().apply(&mut c, v).unwrap();
            }
            let want = Limit {
                rate: 5,
                max: 6,
                max_length: 7,
            };
            let q = c.qos.as_ref().unwrap();
            assert_eq!(*q.limit(b), want, "{b:?}");
            let others = Bucket::ALL.iter().filter(|&&o| o != b);
            assert!(others.map(|&o| *q.limit(o)).all(|l| l == Limit::default()));
            assert_eq!(
                pairs(&c),
                [(rate, "5".into()), (max, "6".into()), (len, "7".into())]
            );
        }
    }

    /// Every key's value reads back through its own parser: what `save_config` writes recreates
    /// the export.
    #[test]
    fn an_export_round_trips_through_its_pairs() {
        let rbd_specs = [
            "socket=/run/f.sock,engine=rbd,pool=p,image=i,namespace=n,conf=/etc/ceph/x.conf,user=u,keyring=/k,timeout=5,size=1G,direct=off",
            "socket=/run/g.sock,engine=rbd,pool=p,image=i",
        ];
        // engine=rbd parses only in a build that can serve it.
        let rbd_specs = if rbd::BUILT { &rbd_specs[..] } else { &[] };
        for spec in rbd_specs.iter().copied().chain([
            "socket=/run/a.sock,path=/img,queues=4,threads=2,cpus=0-3,readonly=on,direct=off,serial=x,poll=on,poll-max-us=7,poll-engine-us=9,batch-wait-us=3,merge=off,fixed-files=off,fixed-buffers=on,sqpoll-idle-ms=5,coop-taskrun=off,submit-early=off,notify-early=off,queue-size=256,id=disk-1",
            "socket=/run/b.sock,engine=null,size=1G",
            "socket=/run/c.sock,engine=mem,size=64M,threads=per-queue",
            "socket=/run/d.sock,engine=null,size=1G,iops-read=100,iops-read-max=1000,iops-read-max-length=60,iops-write=50,iops-write-max=60,bps-total=1048576,bps-total-max=2097152,bps-total-max-length=3,iops-size=4096,group=g",
            "socket=/run/e.sock,engine=null,size=1G,iops-total=5,iops-total-max=6,iops-total-max-length=2,bps-read=7,bps-read-max=8,bps-read-max-length=9,bps-write=10,bps-write-max=11,bps-write-max-length=12",
        ]) {
            let cfg = super::super::parse_export_spec(spec).unwrap();
            let again = ExportConfig::from_pairs(pairs(&cfg)).unwrap();
            assert_eq!(again, cfg, "{spec}");
        }
    }

    #[test]
    fn names_are_unique_and_help_fits() {
        let all: Vec<&Key> = keys().collect();
        for (i, k) in all.iter().enumerate() {
            assert!(
                all[i + 1..].iter().all(|o| o.name != k.name),
                "{} twice",
                k.name
            );
            assert!(!k.help.is_empty() && !k.allowed.is_empty());
        }
        for line in spec_help().lines() {
            assert!(line.chars().count() <= 100, "help line too long: {line}");
        }
    }

    /// The README documents exactly the keys of the table, with the table's words.
    #[test]
    fn readme_lists_every_key() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
            .expect("README.md at the workspace root");
        let rows = readme_rows();
        for row in &rows {
            assert!(
                readme.contains(row.as_str()),
                "README.md lacks this row of the export key table (generated from config::keys):\n{row}"
            );
        }
        // Any README row for a known key must be the generated one (no stale wording).
        let stale: Vec<&str> = readme
            .lines()
            .filter(|l| {
                let name = l.strip_prefix("| `").and_then(|r| r.split('=').next());
                name.and_then(key).is_some() && !rows.iter().any(|r| r == l)
            })
            .collect();
        assert!(
            stale.is_empty(),
            "README rows that differ from config::keys: {stale:#?}"
        );
    }
}
