#!/usr/bin/python3
"""A device of a 3-device pool goes away for good mid-run, and later comes back.

`alloy launch --rejoin-timeout 3 --max-restarts 1 ... -- alloy train --plan auto`: after step 12
the quarter device is taken away (MODE emulated: `alloy emu down h2` on the emulated
examples/cluster-3dev.yaml, which kills its rank and cuts its links; MODE check: its rank is killed
and --device-check reports its device missing). The launcher waits 3 s for it, then starts the two
survivors, which re-plan onto the two devices and resume the last complete checkpoint.
Once the device is back the launcher asks the job to stop at its next checkpoint and starts it
again on all three devices, re-planned. Checked: the job finishes every step once, its losses equal
a one-device run's within 1e-5 relative, the plans had 3, 2 and 3 ranks, and the launcher's log
and OUTPUT/membership.json say what happened and when.

usage: test_elastic.py ALLOY WORKDIR [emulated|check]
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from distlib import fresh_workdir_with_corpus, metrics_rows, paused, popen_collect, rank_pid, sh  # noqa: E402

STEPS = 40
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def config(work, out):
    path = out + ".yaml"
    with open(path, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 4, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: 16, lr: 1e-3, warmup: 2, eval_interval: 0, eval_batches: 1,
        checkpoint_interval: 5, threads: 1, replan_step: 0}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "emulated"
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cluster = os.path.join(REPO, "examples", "cluster-3dev.yaml")

    ref = os.path.join(work, "one-device")
    sh([alloy, "train", "--config", config(work, ref)], env=env)
    ref_loss = [r["loss"] for r in metrics_rows(ref)]

    out = os.path.join(work, "elastic")
    cfg = config(work, out)
    gone = os.path.join(work, "gone-2")
    launch = [alloy, "launch", "--max-restarts", "1", "--rejoin-timeout", "3", "--threads-per-rank", "1"]
    if mode == "emulated":
        launch += ["--emulate", cluster]
    else:
        launch += ["--nproc", "3", "--device-check", f"test ! -e {work}/gone-{{rank}}"]
    cmd = launch + ["--", alloy, "train", "--config", cfg, "--plan", "auto", "--cluster", cluster, "--timeout", "30"]
    p, lines = popen_collect(cmd, env)

    removed_at = back_at = None
    deadline = time.time() + 420
    while p.poll() is None and time.time() < deadline:
        n = len(metrics_rows(out))
        if removed_at is None and n >= 12:
            # The survivors are paused while the device goes: `alloy emu down` starts a LibTorch-linked
            # binary and runs `tc`, and CI's machine trained the 28 remaining steps before it had cut
            # anything (the kill then came after the last checkpoint, leaving nothing to resume).
            with paused(cfg, (0, 1)):
                if mode == "emulated":
                    subprocess.run([alloy, "emu", "down", "h2"], check=True, capture_output=True)
                else:
                    open(gone, "w").close()
                    pid = rank_pid(cfg, 2)
                    if pid:
                        os.kill(pid, 9)
            removed_at = n
        # Back once the two survivors have trained two steps of their own.
        resumed = [int(l.rsplit(" ", 1)[1]) for l in lines if "resumed from" in l and " at step " in l]
        if removed_at is not None and back_at is None and resumed and n >= resumed[0] + 2:
            # The survivors are paused until the launcher has seen the device back: two devices train a
            # step in ~0.1 s, so without the pause the job could reach its last checkpoint before the
            # launcher's next look (once a second), and nothing would be left to rejoin (CI saw this).
            with paused(cfg, (0, 1)):
                if mode == "emulated":
                    subprocess.run([alloy, "emu", "up", "h2"], check=True, capture_output=True)
                else:
                    os.unlink(gone)
                seen = time.time() + 20
                while time.time() < seen and not any("is available again" in l for l in lines):
                    time.sleep(0.05)
            back_at = n
        time.sleep(0.05)
    if p.poll() is None:
        p.kill()
    p.wait()
    time.sleep(0.2)
    log = "".join(lines)

    rows = metrics_rows(out)
    steps_ok = [r["step"] for r in rows] == list(range(1, STEPS + 1))
    worst = max((abs(r["loss"] - l) / abs(l) for r, l in zip(rows, ref_loss)), default=1.0)
    try:
        with open(os.path.join(out, "membership.json")) as f:
            starts = json.load(f)["starts"]
    except (FileNotFoundError, ValueError, KeyError):
        starts = []
    sizes = [s["world_size"] for s in starts]
    names = [s.get("devices") for s in starts]
    said = {
        "waits for the device": "waiting up to 3 s (--rejoin-timeout)" in log,
        "goes on without it": "continuing on 2 of 3 devices" in log,
        "plans onto the rest": "planning onto them" in log,
        "resumes the checkpoint": "resuming from" in log,
        "takes it back": "is available again" in log and "every device is available" in log,
        "finished": "the job finished after 1 restart(s) and 1 rejoin(s)" in log,
    }
    ok = (p.returncode == 0 and removed_at is not None and back_at is not None and steps_ok and worst <= 1e-5 and
          sizes == [3, 2, 3] and names[1] == ["fast", "half"] and all(said.values()))
    print(f"{'ok  ' if ok else 'FAIL'} elastic ({mode}): quarter device removed after step {removed_at}, back after step "
          f"{back_at}; job exit {p.returncode}; steps 1..{STEPS} once: {steps_ok}; worst loss difference to one device "
          f"{worst:.2e} (<= 1e-5); world sizes {sizes}, devices {names}; log: {said}")
    for s in starts:
        print(f"     {s['time']} launch {s['launch']}: {s['world_size']} ranks on {s.get('devices')}: {s.get('plan')}")
    if not ok:
        print(log[-6000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
