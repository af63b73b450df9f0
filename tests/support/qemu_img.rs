//! QEMU's own image tools as the independent reference for qcow2 images mqblk wrote:
//! `qemu-img` (check, convert, info, create) and `qemu-io`.

use std::path::Path;
use std::process::Command;

use super::qemu::SETUP_HINT;

/// Runs `qemu-img ARGS`; returns its exit code and its output (stdout, then stderr).
pub fn qemu_img(args: &[&str]) -> Result<(i32, String), String> {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run qemu-img {args:?}: {e}; {SETUP_HINT}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.code().unwrap_or(-1), text))
}

/// [`qemu_img`], which must exit 0: its output.
pub fn qemu_img_ok(args: &[&str]) -> String {
    match qemu_img(args) {
        Ok((0, text)) => text,
        Ok((code, text)) => panic!("qemu-img {args:?} exited {code}: {text}"),
        Err(e) => panic!("{e}"),
    }
}

/// `qemu-img create -f qcow2`: a new qcow2 image of `size` (qemu-img's syntax, e.g. `16M`) at
/// `path`, QEMU's defaults otherwise.
pub fn create_qcow2(path: &Path, size: &str) {
    qemu_img_ok(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        &path.display().to_string(),
        size,
    ]);
}

/// The dirty bit of the qcow2 header of `img` (incompatible features, byte 79).
pub fn dirty_bit(img: &Path) -> u8 {
    use mqblk::format::qcow2::header::{DIRTY, DIRTY_BYTE};
    (std::fs::read(img).unwrap()[DIRTY_BYTE as usize] >> DIRTY) & 1
}

/// `qemu-img check`: no corruption and, unless `leaks_allowed`, no leaked cluster (exit 0:
/// clean; 3: leaked clusters only; 2: corruption; 1: could not check).
pub fn assert_checks_clean(image: &Path, leaks_allowed: bool) {
    let (code, text) = qemu_img(&["check", &image.display().to_string()]).unwrap();
    let ok = code == 0 || (leaks_allowed && code == 3);
    assert!(
        ok,
        "qemu-img check {} exited {code}:\n{text}",
        image.display()
    );
}

/// The guest-visible bytes of `image`, as QEMU reads them (`qemu-img convert` to a raw file
/// `scratch`, read back and removed).
pub fn read_through_qemu(image: &Path, scratch: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(scratch);
    qemu_img_ok(&[
        "convert",
        "-O",
        "raw",
        &image.display().to_string(),
        &scratch.display().to_string(),
    ]);
    let bytes = std::fs::read(scratch).unwrap();
    let _ = std::fs::remove_file(scratch);
    bytes
}

/// Runs `qemu-io -f FORMAT -c COMMAND image`: its exit code and its output (stdout, then
/// stderr).
pub fn qemu_io(format: &str, image: &Path, command: &str) -> (i32, String) {
    let out = Command::new("qemu-io")
        .args(["-f", format, "-c", command])
        .arg(image)
        .output()
        .unwrap_or_else(|e| panic!("cannot run qemu-io: {e}; {SETUP_HINT}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// [`qemu_io`] on a qcow2 image, which must exit 0 and pass its `-P` pattern checks: its output. (QEMU 10's
/// qemu-io exits 1 on a failed check; older ones exit 0 and only say so, so the text is checked
/// too.)
pub fn qemu_io_ok(image: &Path, command: &str) -> String {
    let (code, text) = qemu_io("qcow2", image, command);
    assert!(
        code == 0 && !text.contains("Pattern verification failed"),
        "qemu-io -c {command:?} {} exited {code}: {text}",
        image.display()
    );
    text
}
