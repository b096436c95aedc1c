#!/usr/bin/python3
"""The tree all-reduce around slow links across real processes (tests/tree_allreduce_check.cpp).

usage: test_tree_allreduce.py ALLOY CHECK
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distlib import Checks  # noqa: E402

# (ranks, slow pairs, stripes, the rank that leaves or None, the trees' roots ("R" a member,
# "R-T" a root edge) or None)
CASES = [
    (3, "0:2", 1, None, "1"),              # the 3-device pool: a chain through rank 1
    (4, "0:2,0:3,1:2,1:3", 1, None, "1-2"),  # two regions of two: rooted at the one slow edge
    (4, "0:2,0:3,1:2,1:3", 2, None, "1-2, 0-3"),  # the same striped: slices along 1-2 and 0-3 at once
    (5, "0:4,1:3,2:4", 1, None, None),
    (3, "0:2", 1, 2, None),               # a leaf leaves
    (3, "0:2", 1, 1, None),               # the root leaves
    (4, "0:2,0:3,1:2,1:3", 2, 3, None),   # a member of both stripes (an end of a root edge) leaves
    (4, "0:2,0:3,1:2,1:3", 1, 2, None),   # the twin leaves
]


def main():
    alloy, check = sys.argv[1], sys.argv[2]
    ok = Checks()
    for n, slow, stripes, die, roots in CASES:
        cmd = [alloy, "launch", "--nproc", str(n), "--", check, "--slow", slow, "--stripes", str(stripes)]
        cmd += ["--die", str(die)] if die is not None else []
        # A hang guard, not a speed check: the failing cases wait at most a 20 s collective timeout.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        what = f"{n} ranks, slow {slow}, {stripes} stripe(s)" + (f", rank {die} leaves" if die is not None else "")
        if die is None:
            good = r.returncode == 0 and out.count("tree-allreduce ok") == n
            if roots is not None:
                good = good and out.count(f"roots {roots}, ") == n
            ok(good, f"{what}: every rank has the tree's total bit for bit" + (f" (roots {roots})" if roots else ""))
        else:
            good = r.returncode == 0 and out.count("failed as expected") == n - 1
            ok(good, f"{what}: the others fail naming the tree and a rank")
        if not good:
            sys.stdout.write(out[-4000:])
    ok.finish()


if __name__ == "__main__":
    main()
