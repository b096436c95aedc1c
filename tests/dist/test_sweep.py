#!/usr/bin/python3
"""`alloy sweep` on a CI-sized grid: 3 layouts (dp, pp, tp) x 3 micro-batch sizes x 2 sequence
lengths of a LoRA fine-tuning run on 2 local ranks; then rank counts 1 and 2 as an axis. Every cell that can run is run and measured,
has the planner's prediction beside it, and lands in the CSV, the JSON and the plots; a micro-batch
size that does not divide the batch is listed as skipped with why. Then tensor parallelism without
LoRA: an even and a 3:1 split of the heads, both run.

usage: test_sweep.py ALLOY WORKDIR
"""
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distlib import fresh_workdir_with_corpus, sh  # noqa: E402


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    fresh_workdir_with_corpus(alloy, work)
    cfg = os.path.join(work, "ft.yaml")
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: llama, layers: 4, hidden: 32, heads: 4, kv_heads: 2, seq_len: 32, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: 4, global_batch: 8, lr: 1e-2, warmup: 1, threads: 1}}
lora: {{rank: 4, targets: all}}
output: {{dir: {work}/unused}}
""")
    out = os.path.join(work, "sweep")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = sh([alloy, "sweep", "-c", cfg, "-n", "2", "--layouts", "dp", "pp", "tp", "--micro-batch", "1", "2", "3",
            "--seq-len", "16", "32", "--steps", "3", "--warmup", "1", "-o", out], env=env)
    checks = []

    def check(name, ok, detail=""):
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    with open(os.path.join(out, "sweep.csv")) as f:
        rows = list(csv.DictReader(f))
    check("one row per cell", len(rows) == 3 * 3 * 2, f"{len(rows)} rows")
    ran = [x for x in rows if x["status"] == "ok"]
    check("dp, pp and tp (LoRA over tensor-parallel pieces) ran at micro-batch 1 and 2, both lengths", len(ran) == 12
          and all(x["micro_batch"] != "3" for x in ran),
          ", ".join(f"{x['layout']} m={x['micro_batch']} T={x['seq_len']}: {x['status']}" for x in rows))
    check("measured and predicted beside each other",
          all(float(x["tokens_per_s"]) > 0 and float(x["step_s"]) > 0 and float(x["predicted_step_s"]) > 0
              and float(x["mem_max_bytes"]) > 0 and float(x["predicted_mem_max_bytes"]) > 0
              and float(x["mem_imbalance"]) >= 1.0 and float(x["mem_sum_bytes"]) >= float(x["mem_max_bytes"]) for x in ran))
    # The pipeline splits the model: its largest rank holds less than a data-parallel replica.
    def mem(layout, m, t):
        return float(next(x for x in ran if (x["layout"], x["micro_batch"], x["seq_len"]) == (layout, m, t))["mem_max_bytes"])
    check("a pipeline stage holds less than a replica", mem("pp", "1", "32") < mem("dp", "1", "32"),
          f"{mem('pp', '1', '32'):.0f} vs {mem('dp', '1', '32'):.0f} bytes")
    skipped = [x for x in rows if x["micro_batch"] == "3"]
    check("a size that does not divide the batch is skipped with why",
          len(skipped) == 6 and all(x["status"] == "skipped" and "micro-batches of 3" in x["note"]
                                    and ("does not split" in x["note"] or "not a whole number" in x["note"]) for x in skipped))
    with open(os.path.join(out, "sweep.json")) as f:
        j = json.load(f)
    errs = j["prediction_errors"]
    check("prediction error distribution", errs["step"]["rows"] == 12 and errs["memory"]["rows"] == 12 and "median" in errs["step"],
          f"step median {errs['step'].get('median', 0):+.2f}, memory median {errs['memory'].get('median', 0):+.2f}")
    pngs = [p for p in ("sweep-tokens.png", "sweep-latency.png", "sweep-memory.png") if os.path.getsize(os.path.join(out, p)) > 1000]
    check("plots", len(pngs) == 3, ", ".join(pngs))
    check("summary printed", "prediction error (step)" in r.stdout)
    check("one rank count keeps the names without a count",
          j["ranks"] == 2 and isinstance(j["cluster"], str) and all(x["ranks"] == 2 for x in j["rows"])
          and all(os.path.exists(os.path.join(out, f)) for f in ("local-cluster.yaml", "profile-T16.json", "profile-T32.json")))

    # Tensor parallelism without LoRA: both splits run; the 3:1 split holds 3/4 of each block on rank 0.
    plain = os.path.join(work, "plain.yaml")
    with open(plain, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 2, hidden: 32, heads: 4, seq_len: 32, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: 4, global_batch: 4, lr: 1e-2, warmup: 1, threads: 1}}
output: {{dir: {work}/unused}}
""")
    out_tp = os.path.join(work, "sweep-tp")
    sh([alloy, "sweep", "-c", plain, "-n", "2", "--layouts", "tp", "tp:3,1", "tp:1,1,2", "--micro-batch", "2",
        "--steps", "3", "--warmup", "1", "-o", out_tp], env=env)
    with open(os.path.join(out_tp, "sweep.csv")) as f:
        tp_rows = {x["layout"]: x for x in csv.DictReader(f)}
    check("tensor parallelism runs, measured and predicted",
          all(tp_rows[k]["status"] == "ok" and float(tp_rows[k]["tokens_per_s"]) > 0 and float(tp_rows[k]["predicted_step_s"]) > 0
              for k in ("tp", "tp:3,1")), ", ".join(f"{k}: {v['status']} {v['note']}" for k, v in tp_rows.items()))
    check("a 3:1 split holds unevenly, an even one evenly",
          float(tp_rows["tp:3,1"]["mem_imbalance"]) > float(tp_rows["tp"]["mem_imbalance"]),
          f"imbalance {tp_rows['tp:3,1']['mem_imbalance']} vs {tp_rows['tp']['mem_imbalance']}")
    check("a split of the wrong length is skipped with why",
          tp_rows["tp:1,1,2"]["status"] == "skipped" and "3 head counts for 2 ranks" in tp_rows["tp:1,1,2"]["note"])
    # The study's "# of GPUs" axis: several rank counts, one grid each, the count in every row.
    out_n = os.path.join(work, "sweep-ranks")
    sh([alloy, "sweep", "-c", plain, "-n", "1", "2", "--layouts", "dp", "zero2", "--micro-batch", "2", "--steps", "3", "--warmup", "1",
        "-o", out_n], env=env)
    with open(os.path.join(out_n, "sweep.csv")) as f:
        n_list = list(csv.DictReader(f))
    n_rows = {(x["layout"], x["ranks"]): x for x in n_list}
    check("a grid per rank count, each cell run on its own count",
          len(n_list) == 4 and sorted(n_rows) == [("dp", "1"), ("dp", "2"), ("zero2", "1"), ("zero2", "2")]
          and all(x["status"] == "ok" and float(x["predicted_step_s"]) > 0 for x in n_rows.values())
          and all(os.path.exists(os.path.join(out_n, f"profile-n{k}-T32.json")) for k in (1, 2)),
          ", ".join(f"{k}: {v['status']} {v['note']}" for k, v in n_rows.items()))
    # ranks.json of each cell lists the ranks that ran it: one rank's memory is the sum at 1, two
    # ranks' add up at 2. (Measured heap bytes of this tiny model move by more than ZeRO saves, so
    # the sharding's saving is checked on the cost model's figures.)
    one = [x for k, x in n_rows.items() if k[1] == "1"]
    two = [x for k, x in n_rows.items() if k[1] == "2"]
    check("one rank reported per cell at 1, two at 2",
          all(float(x["mem_sum_bytes"]) == float(x["mem_max_bytes"]) for x in one)
          and all(float(x["mem_sum_bytes"]) > 1.5 * float(x["mem_max_bytes"]) for x in two),
          ", ".join(f"{k}: {x['mem_sum_bytes']} / {x['mem_max_bytes']}" for k, x in n_rows.items()))
    check("ZeRO-2 over two ranks is predicted to hold less per rank than data parallelism",
          float(n_rows[("zero2", "2")]["predicted_mem_max_bytes"]) < float(n_rows[("dp", "2")]["predicted_mem_max_bytes"]),
          f"{n_rows[('zero2', '2')]['predicted_mem_max_bytes']} vs {n_rows[('dp', '2')]['predicted_mem_max_bytes']} bytes")
    with open(os.path.join(out_n, "sweep.json")) as f:
        check("the JSON lists the counts", json.load(f)["ranks"] == [1, 2])
    dup = sh([alloy, "sweep", "-c", plain, "-n", "2", "2", "--layouts", "dp", "-o", os.path.join(work, "sweep-dup")], env=env,
             expect_fail=True)
    check("a count listed twice is refused before anything is written",
          "listed twice" in dup.stderr and not os.path.exists(os.path.join(work, "sweep-dup")), dup.stderr.strip()[-200:])
    bad_n = sh([alloy, "sweep", "-c", plain, "-n", "1", "2", "--cluster", os.path.join(out_n, "local-cluster-n2.yaml"),
                "--layouts", "dp", "-o", os.path.join(work, "sweep-bad-n")], env=env, expect_fail=True)
    check("several counts with a fixed pool are refused", "several rank counts" in bad_n.stderr, bad_n.stderr.strip()[-200:])

    # A misspelled layout fails before anything is profiled; the study's names (ddp, fsdp2) are known.
    bad = sh([alloy, "sweep", "-c", plain, "-n", "2", "--layouts", "ddp", "fsdp2", "fsdp3", "--micro-batch", "2",
              "-o", os.path.join(work, "sweep-bad")], env=env, expect_fail=True)
    check("an unknown layout is named before profiling",
          "unknown layout 'fsdp3'" in bad.stderr and "ddp" in bad.stderr
          and not os.path.exists(os.path.join(work, "sweep-bad")), bad.stderr.strip()[-300:])
    failed = checks.count(False)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
