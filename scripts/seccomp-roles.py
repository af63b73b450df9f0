#!/usr/bin/env python3
"""The system calls each thread role of `mqblk serve` made, from the traces of
scripts/seccomp-measure.sh (one directory per daemon run, `strace -ff` files `t.TID` in it).

Roles: `io`, an I/O thread (named mqblk-io*) after its own filter went on (its first
`seccomp(SECCOMP_SET_MODE_FILTER, 0, ...)`); `control`, the main thread after the process-wide
filter (`SECCOMP_FILTER_FLAG_TSYNC`) and every other thread of a confined daemon. Runs that are
not `serve` (`mqblk bench`, `mqblk ctl`) are left out. Prints each role's calls with a count
and a first example.
"""
import collections
import os
import re
import sys

CALL = re.compile(r"^(?:<\.\.\. )?([a-z_0-9]+)(?:\(| resumed>)")


def filter_line(lines, tsync):
    """Index of the line installing the process-wide (tsync) or a thread's own filter."""
    flag = "SECCOMP_FILTER_FLAG_TSYNC" if tsync else "0"
    for i, line in enumerate(lines):
        if line.startswith(f"seccomp(SECCOMP_SET_MODE_FILTER, {flag},"):
            return i
    return None


def thread_name(lines):
    for line in lines:
        m = re.search(r'prctl\(PR_SET_NAME, "([^"]*)"', line)
        if m:
            return m.group(1)
    return ""


def main(root):
    calls = collections.defaultdict(collections.Counter)
    example = collections.defaultdict(dict)
    for run in sorted(os.listdir(root)):
        d = os.path.join(root, run)
        try:
            if not open(os.path.join(d, "args")).read().startswith("serve"):
                continue
        except OSError:
            continue
        threads = {}
        for f in os.listdir(d):
            if f.startswith("t."):
                threads[f] = open(os.path.join(d, f), errors="replace").read().splitlines()
        if not any(filter_line(lines, True) is not None for lines in threads.values()):
            continue  # not confined (--sandbox off, or it failed before)
        for lines in threads.values():
            name = thread_name(lines)
            own = filter_line(lines, False)
            tsync = filter_line(lines, True)
            if name.startswith("mqblk-io") and own is not None:
                role, start = "io", own + 1
            elif tsync is not None:
                role, start = "control", tsync + 1
            else:
                role, start = "control", 0  # started after the process-wide filter
            for line in lines[start:]:
                m = CALL.match(line)
                if m:
                    calls[role][m.group(1)] += 1
                    example[role].setdefault(m.group(1), f"{name or '-'}: {line[:100]}")
    for role in sorted(calls):
        print(f"== {role}: {len(calls[role])} calls")
        for call, n in sorted(calls[role].items()):
            print(f"  {call:22} {n:8}  {example[role][call]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
