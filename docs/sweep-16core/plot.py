# Draws a labelled IOPS-against-jobs plot from a `mqblk bench` results.json, or from the log a
# run printed when its results.json did not come back (one "[k/n] label, workload, jobs J,
# iodepth D: N IOPS" line per sample). The 16-CPU machine has no fonts, so the plot mqblk bench
# draws there has no labels. Needs matplotlib:
#   python3 plot.py results.json|run.log iops.png [title]
import json, re, statistics as st, sys, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

samples = {}  # label -> jobs -> [IOPS]
src = sys.argv[1]
if src.endswith(".json"):
    d = json.load(open(src))
    for p in d["points"]:
        for s in p["samples"]:
            if not s["error"]:
                samples.setdefault(p["label"], {}).setdefault(p["jobs"], []).append(s["iops"])
    title = f"null engine, 4k randread, iodepth 32, {d['host']['nproc']} CPUs ({d['host']['date']})"
else:
    line = re.compile(r"\[\d+/\d+\] (.+?), [^,]+, jobs (\d+), iodepth \d+: (\d+) IOPS")
    for l in open(src):
        m = line.match(l)
        if m:
            samples.setdefault(m[1], {}).setdefault(int(m[2]), []).append(int(m[3]))
    title = "null engine, 4k randread, iodepth 32"
if len(sys.argv) > 3:
    title = sys.argv[3]

fig, ax = plt.subplots(figsize=(8, 5))
for label, by_jobs in samples.items():
    pts = sorted((j, st.median(v) / 1e6, min(v) / 1e6, max(v) / 1e6) for j, v in by_jobs.items())
    ax.errorbar([x[0] for x in pts], [x[1] for x in pts],
                yerr=[[x[1] - x[2] for x in pts], [x[3] - x[1] for x in pts]],
                marker="o", capsize=3, label=label)
ax.set_xscale("log", base=2)
ax.set_xticks([1, 2, 4, 8, 16])
ax.set_xticklabels(["1", "2", "4", "8", "16"])
ax.set_xlabel("jobs (client threads = queues)")
ax.set_ylabel("M IOPS (median, min-max)")
ax.set_title(title)
ax.grid(True, alpha=.3)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=100)
