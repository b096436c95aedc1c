#!/usr/bin/python3
"""Link emulation: the bandwidth two emulated hosts really get under a tc limit.

Builds a 2-host emulated cluster per limit (`alloy launch --emulate`, root), lets `alloy profile`
measure the link with Gloo ping-pongs of up to 2 MiB (the figure the planner uses), and prints
measured / limit. Writes bench/results/link.json and link.png (gnuplot).
usage: /usr/bin/python3 bench/link_bench.py [--build build] [--limits-mbit 100 20 500]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import plot  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--limits-mbit", type=float, nargs="+", default=[100.0, 20.0, 500.0])
    a = ap.parse_args()
    alloy = os.path.abspath(os.path.join(a.build, "alloy"))
    work = tempfile.mkdtemp(prefix="alloy-link-bench-")
    rows = []
    for mbit in a.limits_mbit:
        spec = os.path.join(work, f"link-{mbit:g}.yaml")
        with open(spec, "w") as f:
            f.write(f"""name: link-{mbit:g}
devices:
  - {{name: a, host: h0, kind: cpu, type: cpu, memory_gb: 4, speed: 1.0}}
  - {{name: b, host: h1, kind: cpu, type: cpu, memory_gb: 4, speed: 1.0}}
default_link: {{bandwidth_gbps: {mbit / 1000:g}, latency_ms: 0.1}}
""")
        out = os.path.join(work, f"profile-{mbit:g}.json")
        r = subprocess.run([alloy, "launch", "--emulate", spec, "--no-cpu-limit", "--", alloy, "profile", "--cluster", spec,
                            "--config", os.path.join(REPO, "examples", "tiny-gpt2.yaml"), "--set", "model.layers=1",
                            "-o", out], capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            sys.exit(f"emulated profile failed:\n{r.stderr[-3000:]}")
        link = json.load(open(out))["links"][0]
        got = link["bytes_per_s"] * 8 / 1e6
        rows.append(dict(limit_mbit=mbit, measured_mbit=got, ratio=got / mbit))
        print(f"limit {mbit:7.1f} Mbit/s: measured {got:7.1f} Mbit/s ({100 * got / mbit:.0f}%)", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "link.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(benchmark="link", when=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), f, indent=2)
    os.replace(path + ".tmp", path)
    png = os.path.join(HERE, "results", "link.png")
    plot.bars(png, "Emulated link: tc limit vs bandwidth measured with Gloo", "Mbit/s", [f"{r['limit_mbit']:g} Mbit/s" for r in rows],
              {"limit": [r["limit_mbit"] for r in rows], "measured": [r["measured_mbit"] for r in rows]})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
