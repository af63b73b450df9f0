//! The TOML config file (`mqblk serve --config`): `[[export]]` tables with the same keys as
//! `--export`, read into exports and written from them (the management API's `save_config`),
//! and the whole-file writes that save it and the stats file.

use std::io;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{keys, ConfigError, ExportConfig};

/// A TOML config file: `[[export]]` tables with the same keys as `--export`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    export: Vec<toml::Table>,
    #[serde(rename = "log-level")]
    log_level: Option<String>,
}

/// A TOML value as the string `key=value` would carry (booleans as on/off).
fn value_str(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Boolean(b) => if *b { "on" } else { "off" }.to_string(),
        other => other.to_string(),
    }
}

/// Reads a TOML config file into exports and an optional log level.
pub fn parse_config_file(text: &str) -> Result<(Vec<ExportConfig>, Option<String>), ConfigError> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| ConfigError::Toml(e.to_string()))?;
    let mut out = Vec::new();
    for (i, table) in file.export.iter().enumerate() {
        let pairs = table.iter().map(|(k, v)| (k.as_str(), value_str(v)));
        let cfg = ExportConfig::from_pairs(pairs).map_err(|e| ConfigError::InTable {
            index: i + 1,
            error: Box::new(match e {
                ConfigError::UnknownKey(k) => ConfigError::UnknownField(k),
                e => e,
            }),
        })?;
        out.push(cfg);
    }
    Ok((out, file.log_level))
}

/// The TOML config file that recreates `exports` (`mqblk serve --config`).
pub fn config_toml(exports: &[ExportConfig]) -> String {
    let mut out = String::from("# Written by mqblk's save_config: the exports it was serving.\n");
    for cfg in exports {
        let mut table = toml::Table::new();
        for (k, v) in keys::pairs(cfg) {
            table.insert(k.to_string(), toml::Value::String(v));
        }
        out.push_str("\n[[export]]\n");
        out.push_str(&toml::to_string(&table).expect("a table of strings serialises"));
    }
    out
}

/// Writes `text` to `path` through a temporary file beside it and a rename, so that a reader
/// sees the old file or the new one, never half of one (save_config, the stats file).
pub fn write_atomically(path: &Path, text: &str) -> io::Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_file() {
        let (ex, lvl) = parse_config_file(
            r#"
log-level = "debug"
[[export]]
socket = "/tmp/a.sock"
path = "/tmp/a.img"
queues = 2
readonly = true
[[export]]
socket = "/tmp/b.sock"
engine = "null"
size = "1G"
threads = "per-queue"
"#,
        )
        .unwrap();
        assert_eq!(lvl.as_deref(), Some("debug"));
        assert_eq!(ex.len(), 2);
        assert!(ex[0].readonly);
        assert_eq!(ex[0].queues, 2);
        assert_eq!(ex[1].size, Some(1 << 30));
        let err = parse_config_file("[[export]]\nsocket='x'\nengine='zzz'\nsize='1M'\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("engine=zzz"), "{err}");
        let err = parse_config_file("[[export]]\nsockett='x'\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sockett"), "{err}");
    }
}
