# Draws iops.png from a results.json with labels (the 16-CPU machine has no fonts, so the
# plot mqblk bench draws there has none): python3 plot.py results.json iops.png (needs matplotlib)
import json, statistics as st, sys, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))
series = {}
for p in d['points']:
    iops = [s['iops'] for s in p['samples'] if not s['error']]
    series.setdefault(p['label'], []).append((p['jobs'], st.median(iops)/1e6, min(iops)/1e6, max(iops)/1e6))
fig, ax = plt.subplots(figsize=(8,5))
for label, pts in series.items():
    pts.sort()
    j = [x[0] for x in pts]; m = [x[1] for x in pts]
    ax.errorbar(j, m, yerr=[[x[1]-x[2] for x in pts],[x[3]-x[1] for x in pts]], marker='o', capsize=3, label=label)
ax.set_xscale('log', base=2); ax.set_xticks([1,2,4,8,16]); ax.set_xticklabels(['1','2','4','8','16'])
ax.set_xlabel('jobs (client threads = queues)'); ax.set_ylabel('M IOPS (median, min-max)')
h = d['host']
ax.set_title(f"null engine, 4k randread, iodepth 32, {h['nproc']} CPUs ({h['date']})")
ax.grid(True, alpha=.3); ax.legend()
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=100)
