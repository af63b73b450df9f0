//! The daemon's log on standard error: mqblk's lines at the level asked for, other crates'
//! from `warn` up. Other crates' lines are limited to [`PER_SEC`] a second each, by the same
//! [`LogLimiter`] that limits mqblk's lines about what a guest controls: mqblk limits
//! its own lines about what a guest or an image controls where it logs them, but a library's
//! lines are its own, and imago warns once per cluster it cannot free, which a crafted image
//! makes thousands of times a request. The first line over the limit is written with a note
//! that the rest of that second's are dropped, and the next line let through after them with
//! one saying how many were.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::bail;
use mqblk::log_limit::LogLimiter;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Lines a second let through from each crate other than mqblk.
const PER_SEC: u32 = LogLimiter::PER_SEC;

/// The levels `--log-level` takes by name.
const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

/// Sends the process's log to standard error at `level` (a level name, or a filter
/// directive such as `mqblk=debug,imago=info`).
pub fn init(level: &str) -> anyhow::Result<()> {
    let filter = filter(level)?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    subscriber(filter, std::io::stderr, ansi).init();
    Ok(())
}

/// The filter `--log-level LEVEL` stands for.
fn filter(level: &str) -> anyhow::Result<EnvFilter> {
    let directives = if LEVELS.contains(&level) {
        format!("mqblk={level},warn")
    } else if level.contains('=') {
        level.to_string()
    } else {
        bail!("invalid --log-level {level}: use error, warn, info, debug or trace");
    };
    Ok(EnvFilter::new(directives))
}

/// The log's subscriber, writing to `writer`.
fn subscriber<W>(filter: EnvFilter, writer: W, ansi: bool) -> impl Subscriber + Send + Sync
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi)
        .event_format(NoteDropped(format::format().with_target(false)))
        // A line that cannot be written (the log's reader gone, its filesystem full) is lost.
        // Reported instead, it would go with `eprintln!`, which panics when standard error
        // fails too, in whichever thread logged: an I/O thread, the vhost-user thread.
        .log_internal_errors(false);
    tracing_subscriber::registry()
        .with(filter)
        .with(OtherCratesLimit::default())
        .with(lines)
}

/// What is said of dropped lines after the line let through.
#[derive(Clone, Copy)]
enum Note {
    /// This crate's lines are dropped for the rest of the second.
    DroppingAfter(&'static str),
    /// So many of this crate's lines were dropped before this one.
    DroppedBefore(&'static str, u64),
}

thread_local! {
    /// Set by [`OtherCratesLimit`] for the line it lets through, read by [`NoteDropped`] as
    /// it writes that line (on the same thread, in the same call).
    static NOTE: Cell<Option<Note>> = const { Cell::new(None) };
}

/// Lets through what a [`LogLimiter`] per crate other than mqblk allows, and the first line
/// it refuses, which says that the rest are dropped.
#[derive(Default)]
struct OtherCratesLimit {
    crates: Mutex<HashMap<&'static str, LogLimiter>>,
}

impl<S: Subscriber> Layer<S> for OtherCratesLimit {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        let target = event.metadata().target();
        let krate = target.split("::").next().unwrap_or(target);
        if krate == "mqblk" {
            return true;
        }
        let mut crates = self.crates.lock().unwrap_or_else(|e| e.into_inner());
        let limiter = crates.entry(krate).or_default();
        let note = match limiter.allow() {
            // The first line the limiter refused was written (below), and is among these.
            Some(counted) if counted > 1 => Note::DroppedBefore(krate, counted - 1),
            Some(_) => return true,
            // The first refused since the last line let through: written, saying so.
            None if limiter.dropped() == 1 => Note::DroppingAfter(krate),
            None => return false,
        };
        NOTE.with(|n| n.set(Some(note)));
        true
    }
}

/// Writes a line as `F` does, and after it what [`NOTE`] says of its crate's dropped lines.
struct NoteDropped<F>(F);

impl<S, N, F> FormatEvent<S, N> for NoteDropped<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        self.0.format_event(ctx, writer.by_ref(), event)?;
        match NOTE.with(Cell::take) {
            Some(Note::DroppingAfter(krate)) => writeln!(
                writer,
                "  (more than {PER_SEC} lines of {krate} this second: the rest of the second's are dropped, and counted with its next line)"
            ),
            Some(Note::DroppedBefore(krate, dropped)) => writeln!(
                writer,
                "  ({dropped} lines of {krate} dropped before the one above: at most {PER_SEC} a second are written)"
            ),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn other_crates_lines_are_limited_and_what_was_dropped_is_said_and_mqblks_are_not() {
        let buf = Buffer::default();
        let out = buf.clone();
        let sub = subscriber(filter("info").unwrap(), move || out.clone(), false);
        tracing::subscriber::with_default(sub, || {
            for i in 0..100 {
                tracing::warn!(target: "imago::qcow2::allocation", i, "cannot free a cluster");
                tracing::warn!(target: "mqblk::engine", i, "a line of mqblk's");
            }
            // A second later, the next line of imago's is let through, with the count.
            std::thread::sleep(std::time::Duration::from_millis(1100));
            tracing::warn!(target: "imago::qcow2", "once more");
            // Below the level asked for: not written, and not counted.
            tracing::info!(target: "imago::qcow2", "an info line");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            text.matches("cannot free a cluster").count(),
            PER_SEC as usize + 1
        );
        assert_eq!(text.matches("a line of mqblk's").count(), 100);
        assert_eq!(
            text.matches("the rest of the second's are dropped").count(),
            1
        );
        assert!(text.contains("once more"));
        assert!(
            text.contains("(89 lines of imago dropped before the one above"),
            "{text}"
        );
        assert!(!text.contains("an info line"));
        assert!(!text.contains("imago::"), "targets are not written: {text}");
    }

    #[test]
    fn a_level_that_is_neither_a_name_nor_a_directive_is_refused() {
        assert!(filter("loud").is_err());
        assert!(filter("mqblk=debug,imago=info").is_ok());
        assert!(filter("debug").is_ok());
    }
}
