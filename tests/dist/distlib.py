"""What the end-to-end tests through real processes share: running a command, a corpus, plans."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys


def sh(cmd, expect_fail=False, **kw):
    """Runs CMD; a failure (or, with EXPECT_FAIL, a success) prints its output's tail and exits 1."""
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if (r.returncode != 0) != expect_fail:
        sys.stderr.write(f"command {'succeeded' if expect_fail else 'failed'} ({r.returncode}): {' '.join(cmd)}\n"
                         f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}\n")
        raise SystemExit(1)
    return r


class Checks:
    """Named checks that all run: each prints ok/FAIL; finish() exits 1 if any failed."""

    def __init__(self):
        self.failed = []

    def __call__(self, ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            self.failed.append(what)

    def finish(self):
        if self.failed:
            print(f"{len(self.failed)} check(s) failed")
            raise SystemExit(1)
        print("all checks passed")


def fresh_workdir_with_corpus(alloy, work):
    """Empties WORK and prepares the first 150 kB of the fortunes corpus as WORK/data/corpus."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open("/usr/share/games/fortunes/fortunes", "rb") as f:
        text = f.read(150000)
    with open(os.path.join(work, "corpus.txt"), "wb") as f:
        f.write(text)
    sh([alloy, "data", "prepare", "--input", os.path.join(work, "corpus.txt"), "--output", os.path.join(work, "data/corpus")])


def plan(gb, pipelines, schedule="1f1b", slow_links=None):
    """pipelines: [(mbs, nmb, [(rank, begin, end), ...]), ...]; a stage may be a tensor-parallel
    group instead: ([ranks], begin, end, tp_split or None)."""
    def stage(s):
        ranks = s[0] if isinstance(s[0], list) else [s[0]]
        st = {"ranks": ranks, "layers": [s[1], s[2]]}
        if len(s) > 3 and s[3]:
            st["tp_split"] = s[3]
        return st
    tp = any(isinstance(s[0], list) and len(s[0]) > 1 for _, _, st in pipelines for s in st)
    p = {"format": "alloy-plan", "version": 4 if tp else 1, "global_batch": gb, "schedule": schedule,
         "pipelines": [{"micro_batch_size": m, "num_micro_batches": n,
                        "stages": [stage(s) for s in st]} for m, n, st in pipelines]}
    if slow_links:
        p["grad_sync"] = {"slow_links": slow_links}
    return p


def full(rank):
    return [(rank, 0, 8)]


def metrics_rows(run_dir):
    """RUN_DIR/metrics.jsonl as dicts; [] before the run has written it."""
    import json
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []


def rank_pid(config_path, rank):
    """The pid of the `alloy train` process of RANK started with --config CONFIG_PATH, or None."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"train" not in cmd or config_path.encode() not in cmd:
                continue
            # A rank that `alloy launch` forked is named after its rank (its environ, the
            # launcher's, has no RANK); an exec'd one has RANK in its environment.
            with open(f"/proc/{pid}/comm", "rb") as f:
                if f.read().strip() == f"alloy-rank{rank}".encode():
                    return int(pid)
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            if env.get(b"RANK") == str(rank).encode():
                return int(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return None


@contextlib.contextmanager
def paused(config_path, ranks):
    """Stops the `alloy train` ranks of CONFIG_PATH (SIGSTOP) for the body of a `with`, so that an action
    taking seconds (an `alloy emu` command) lands at a chosen step however fast the machine trains."""
    pids = [pid for pid in (rank_pid(config_path, r) for r in ranks) if pid]

    def send(sig):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    send(signal.SIGSTOP)
    try:
        yield
    finally:
        send(signal.SIGCONT)


def popen_collect(cmd, env):
    """Starts CMD with stdout+stderr merged; returns (process, list its lines are appended to)."""
    import subprocess
    import threading
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    threading.Thread(target=lambda: [lines.append(l) for l in p.stdout], daemon=True).start()
    return p, lines


def write_json_atomic(path, obj):
    """Writes OBJ to PATH as indented JSON through a temporary file (readers never see half)."""
    import json
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
