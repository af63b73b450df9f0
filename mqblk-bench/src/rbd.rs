//! `--engine rbd`: both backends serve the same RBD image of a running Ceph cluster, mqblk with
//! `engine=rbd` and qemu-storage-daemon with its rbd driver (`qemu-block-extra`), each with
//! librbd's cache off (`direct=on`, `cache.direct=on`). The image is prepared with the `rbd`
//! tool (ceph-common): created at `--size` and filled with data when it is missing, so that
//! reads hit written objects.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context};
use serde::Serialize;

/// The image the bench serves, and how to reach its cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RbdTarget {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// ceph.conf (`None`: librados's default).
    pub conf: Option<PathBuf>,
    /// A keyring for mqblk and the `rbd` tool (QSD's rbd driver reads the one ceph.conf names).
    pub keyring: Option<PathBuf>,
    /// The Ceph client name without `client.`.
    pub user: String,
}

impl RbdTarget {
    /// From `--rbd POOL/IMAGE` and the `--ceph-*` options.
    pub fn parse(
        spec: &str,
        conf: Option<PathBuf>,
        keyring: Option<PathBuf>,
        user: &str,
    ) -> Result<RbdTarget, String> {
        let (pool, image) = spec
            .split_once('/')
            .filter(|(p, i)| !p.is_empty() && !i.is_empty() && !i.contains('/'))
            .ok_or_else(|| format!("--rbd {spec}: POOL/IMAGE, e.g. rbd/bench"))?;
        let bad = |s: &str| s.contains([',', '=', '@']);
        if bad(pool) || bad(image) {
            return Err(format!("--rbd {spec}: names without ',', '=' or '@'"));
        }
        Ok(RbdTarget {
            pool: pool.into(),
            image: image.into(),
            conf,
            keyring,
            user: user.into(),
        })
    }

    /// `pool/image`.
    pub fn spec(&self) -> String {
        format!("{}/{}", self.pool, self.image)
    }

    /// mqblk's export keys for the image.
    pub fn mqblk_keys(&self) -> String {
        let mut s = format!(
            "engine=rbd,pool={},image={},user={},direct=on",
            self.pool, self.image, self.user
        );
        if let Some(c) = &self.conf {
            s.push_str(&format!(",conf={}", c.display()));
        }
        if let Some(k) = &self.keyring {
            s.push_str(&format!(",keyring={}", k.display()));
        }
        s
    }

    /// qemu-storage-daemon's `--blockdev` for the image (node `n0`).
    pub fn qsd_blockdev(&self) -> String {
        let esc = |s: &str| s.replace(',', ",,");
        let mut s = format!(
            "driver=rbd,node-name=n0,pool={},image={},user={},cache.direct=on",
            esc(&self.pool),
            esc(&self.image),
            esc(&self.user)
        );
        if let Some(c) = &self.conf {
            s.push_str(&format!(",conf={}", esc(&c.display().to_string())));
        }
        s
    }

    /// The `rbd` tool with this target's conf, keyring and user.
    fn rbd_cmd(&self) -> Command {
        let mut cmd = Command::new("rbd");
        if let Some(c) = &self.conf {
            cmd.arg("-c").arg(c);
        }
        if let Some(k) = &self.keyring {
            cmd.arg("--keyring").arg(k);
        }
        cmd.arg("--id").arg(&self.user).stdin(Stdio::null());
        cmd
    }

    /// The image's size; a missing image is created at `size` and filled with data first.
    pub fn prepare(&self, size: u64) -> anyhow::Result<u64> {
        let spec = self.spec();
        let out = self
            .rbd_cmd()
            .args(["info", "--format", "json", &spec])
            .output()
            .context("running the rbd tool (install ceph-common; bash .ci/setup does)")?;
        if out.status.success() {
            let info: serde_json::Value = serde_json::from_slice(&out.stdout)
                .with_context(|| format!("rbd info {spec}: not JSON"))?;
            let size = info["size"]
                .as_u64()
                .with_context(|| format!("rbd info {spec}: no size"))?;
            ensure!(
                size >= 1 << 20 && size % 4096 == 0,
                "--rbd {spec}: {size} bytes; an image of at least 1M and a multiple of 4K is needed"
            );
            return Ok(size);
        }
        let err = String::from_utf8_lossy(&out.stderr);
        if !err.contains("No such file") {
            bail!("rbd info {spec}: {}", err.trim());
        }
        println!(
            "creating RBD image {spec} ({} MiB) and filling it with data",
            size >> 20
        );
        // Without exclusive-lock: mqblk's I/O threads each write through their own handle.
        let size_arg = format!("{size}B");
        run(
            self.rbd_cmd().args([
                "create",
                "--size",
                &size_arg,
                "--image-feature",
                "layering",
                &spec,
            ]),
            "rbd create",
        )?;
        let total = size.to_string();
        run(
            self.rbd_cmd().args([
                "bench",
                "--io-type",
                "write",
                "--io-pattern",
                "seq",
                "--io-size",
                "4M",
                "--io-threads",
                "4",
                "--io-total",
                &total,
                &spec,
            ]),
            "rbd bench (filling the image)",
        )?;
        Ok(size)
    }
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("{what}: {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_render() {
        let t = RbdTarget::parse("rbd/bench", Some("/c.conf".into()), None, "admin").unwrap();
        assert_eq!(t.spec(), "rbd/bench");
        assert_eq!(
            t.mqblk_keys(),
            "engine=rbd,pool=rbd,image=bench,user=admin,direct=on,conf=/c.conf"
        );
        assert_eq!(
            t.qsd_blockdev(),
            "driver=rbd,node-name=n0,pool=rbd,image=bench,user=admin,cache.direct=on,conf=/c.conf"
        );
        for bad in ["rbd", "/x", "rbd/", "a/b/c", "a,b/c"] {
            assert!(RbdTarget::parse(bad, None, None, "admin").is_err(), "{bad}");
        }
    }
}
