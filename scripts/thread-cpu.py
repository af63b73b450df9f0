#!/usr/bin/env python3
"""Per-thread CPU of the backends `mqblk bench` starts, grouped by thread name.

Run beside a bench: `scripts/thread-cpu.py SECONDS > threads.jsonl`. For each backend process
that appears (`mqblk serve`, `qemu-storage-daemon`), it waits 1.5 s into the run, then reads
utime+stime of every thread (/proc/PID/task/TID/stat) at the start and end of a 3 s window
and prints one JSON line: the process, the window, CPU seconds by thread name (digits in
names become N, so that msgr-worker-0..2 add up), and the process's user and system seconds
("user", "system"). The lines come in the order the bench ran its points, which matches them
with the bench's per-repeat IOPS (docs/PERFORMANCE.md 9, 13o).
"""
import json
import os
import re
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
DELAY_S, WINDOW_S = 1.5, 3.0


def backends():
    """(pid, name) of every running `mqblk serve` and `qemu-storage-daemon`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        exe = os.path.basename(argv[0].decode(errors="replace")) if argv[0] else ""
        if exe == "qemu-storage-daemon" or (exe == "mqblk" and b"serve" in argv):
            found.append((int(pid), exe))
    return found


def cpu_by_thread_name(pid):
    """CPU seconds so far of each thread of `pid`, summed by name; and the threads' user and
    system seconds in all, under the keys "user" and "system" of a second dict."""
    out, split = {}, {"user": 0.0, "system": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = re.sub(r"\d+", "N", stat[stat.index("(") + 1 : stat.rindex(")")])
        fields = stat[stat.rindex(")") + 2 :].split()
        user, system = int(fields[11]) / HZ, int(fields[12]) / HZ
        out[name] = out.get(name, 0) + user + system
        split["user"] += user
        split["system"] += system
    return out, split


def main():
    seen = set()
    end = time.time() + float(sys.argv[1])
    while time.time() < end:
        for pid, exe in backends():
            if pid in seen:
                continue
            seen.add(pid)
            time.sleep(DELAY_S)
            try:
                (before, split0), t0 = cpu_by_thread_name(pid), time.time()
                time.sleep(WINDOW_S)
                (after, split1), t1 = cpu_by_thread_name(pid), time.time()
            except OSError:
                continue
            cpu = {k: round(v - before.get(k, 0), 3) for k, v in after.items()}
            line = {"exe": exe, "pid": pid, "secs": round(t1 - t0, 2), "cpu": cpu}
            line.update({k: round(split1[k] - split0[k], 3) for k in split1})
            print(json.dumps(line), flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
