//! Parsers for the kinds of value export keys and command-line options take.

/// Parses a size with an optional K/M/G/T suffix (powers of 1024), e.g. `64M`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        (i, 't' | 'T') => (&s[..i], 1 << 40),
        (_, c) if c.is_ascii_digit() => (s, 1),
        _ => return None,
    };
    let n: u64 = num.parse().ok()?;
    n.checked_mul(mult)
}

/// CPU numbers a CPU list may name: below this (the kernel's `CPU_SETSIZE`). A list holds at
/// most this many entries, too (an I/O thread takes one each, and there are far fewer).
pub const MAX_CPUS: usize = 1024;

/// Parses a CPU list such as `2-5,8`, of at most [`MAX_CPUS`] CPUs numbered below it; bounds are
/// checked before a range is expanded, so that no value can make it allocate much.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split([',', ':']) {
        let part = part.trim();
        if part.is_empty() {
            return None;
        }
        let (a, b): (usize, usize) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => {
                let n = part.parse().ok()?;
                (n, n)
            }
        };
        if a > b || b >= MAX_CPUS || out.len() + (b - a + 1) > MAX_CPUS {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// Parses on/off (and true/false, yes/no, 1/0).
pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "on" | "true" | "yes" | "1" => Some(true),
        "off" | "false" | "no" | "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("12Q"), None);
        assert_eq!(parse_size("99999999999999T"), None);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("2-5,8"), Some(vec![2, 3, 4, 5, 8]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("5-2"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(parse_cpu_list("1,,2"), None);
        // CPU numbers stop below MAX_CPUS, and so does the list's length, whatever the ranges.
        assert_eq!(parse_cpu_list("1023").map(|l| l.len()), Some(1));
        assert_eq!(parse_cpu_list("0-1023").map(|l| l.len()), Some(MAX_CPUS));
        assert_eq!(parse_cpu_list("1024"), None);
        assert_eq!(parse_cpu_list("0-4096"), None);
        assert_eq!(parse_cpu_list("5-18446744073709551615"), None);
        assert_eq!(parse_cpu_list("0-1023,0"), None);
        let long = vec!["0-4096"; 10_000].join(",");
        assert_eq!(parse_cpu_list(&long), None);
        let long = vec!["0-1023"; 10_000].join(",");
        assert_eq!(parse_cpu_list(&long), None);
    }

    #[test]
    fn bools() {
        assert_eq!(parse_bool("on"), Some(true));
        assert_eq!(parse_bool("0"), Some(false));
        assert_eq!(parse_bool("maybe"), None);
    }
}
