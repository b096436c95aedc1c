#!/usr/bin/python3
"""SentencePiece tokenizers (LLaMA's tokenizer.model, Megatron's --tokenizer-model) through alloy-spm.

    test_sentencepiece.py ALLOY WORKDIR

Trains a small SentencePiece model on a slice of the fortunes corpus (spm_train), then checks:
  1. `alloy data prepare --tokenizer sentencepiece` writes, document by document, the ids Python's
     sentencepiece module gives for the same text, each document ended by the model's </s>;
  2. a model trains on them with data.tokenizer=sentencepiece, and `alloy generate` / `alloy eval`
     decode and encode through the same model (eval's token count is the module's);
  3. Megatron's --tokenizer-type Llama2Tokenizer --tokenizer-model select it;
  4. a missing or damaged model file, and a helper that is not SentencePiece's, are named errors.
This process never imports torch: SentencePiece and LibTorch do not share a process.
"""
import os
import struct
import subprocess
import sys

import numpy as np
import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "dist"))
from distlib import Checks, sh  # noqa: E402

check = Checks()


def read_indexed(prefix):
    """Megatron's indexed dataset PREFIX.idx/.bin: one int array per document."""
    dtypes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "not an MMIDIDX index"
    version, code, count, docs = struct.unpack_from("<QBQQ", idx, 9)
    sizes = np.frombuffer(idx, np.int32, count, 9 + 25)
    pointers = np.frombuffer(idx, np.int64, count, 9 + 25 + 4 * count)
    data = np.fromfile(prefix + ".bin", dtypes[code])
    item = np.dtype(dtypes[code]).itemsize
    return [data[p // item: p // item + s].astype(np.int64).tolist() for p, s in zip(pointers, sizes)]


def fortune_documents(text):
    docs, cur = [], []
    for line in text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"):
        if line == "%":
            if "".join(cur).strip():
                docs.append("".join(cur))
            cur = []
        else:
            cur.append(line + "\n")
    if "".join(cur).strip():
        docs.append("".join(cur))
    return docs


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    subprocess.run(["rm", "-rf", work], check=True)
    os.makedirs(work)
    with open("/usr/share/games/fortunes/fortunes", "rb") as f:
        text = f.read(120000).decode("utf-8", "replace")
    text = text[: text.rfind("\n%\n") + 3]  # whole fortunes only
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(text)
    model = os.path.join(work, "spm")
    sh(["spm_train", f"--input={corpus}", f"--model_prefix={model}", "--vocab_size=400", "--model_type=bpe",
        "--character_coverage=1.0", "--minloglevel=2"])
    sp = spm.SentencePieceProcessor(model_file=model + ".model")

    # 1. The prepared ids are the module's, document by document, each ended by </s>.
    r = sh([alloy, "data", "prepare", "--input", corpus, "--output", os.path.join(work, "data/spm"), "--tokenizer", "sentencepiece",
            "--tokenizer-model", model + ".model", "--valid-fraction", "0.1"])
    check("vocabulary: 400 (sentencepiece)" in r.stdout, f"prepare reports the model's vocabulary: {r.stdout.strip()[-80:]}")
    docs = fortune_documents(text)
    train = [d for k, d in enumerate(docs) if k % 10 != 9]
    got = read_indexed(os.path.join(work, "data/spm_train"))
    want = [sp.encode(d) + [sp.eos_id()] for d in train]
    check(len(got) == len(want) and len(got) > 100, f"one sequence per document ({len(got)} of {len(want)})")
    same = sum(g == w for g, w in zip(got, want))
    check(same == len(want), f"every document's ids are the SentencePiece module's ({same} of {len(want)})")

    # 2. Training, generation and evaluation through the same model.
    cfg = os.path.join(work, "spm.yaml")
    with open(cfg, "w") as f:
        f.write("model: {arch: llama, layers: 2, hidden: 32, heads: 4, seq_len: 32, vocab_size: 512}\n"
                f"data: {{prefix: {work}/data/spm, tokenizer: sentencepiece, tokenizer_model: {model}.model}}\n"
                "train: {steps: 3, global_batch: 4, eval_interval: 0, threads: 1, checkpoint_interval: 3}\n"
                f"output: {{dir: {work}/run}}\n")
    sh([alloy, "train", "-c", cfg])
    r = sh([alloy, "generate", "--checkpoint", os.path.join(work, "run"), "--prompt", "The fortune", "-n", "24", "--seed", "3"])
    check(r.stdout.strip().startswith("The fortune") and len(r.stdout.strip()) > len("The fortune"),
          f"generate decodes SentencePiece ids: {r.stdout.strip()[:80]!r}")
    sample = os.path.join(work, "sample.txt")
    with open(sample, "w") as f:
        f.write(docs[-1] * 3)
    r = sh([alloy, "eval", "-c", cfg, "--weights", os.path.join(work, "run"), "--text", sample])
    n = len(sp.encode(docs[-1] * 3))
    import json
    ev = json.loads(r.stdout.strip().splitlines()[-1])
    # eval scores every full window of seq_len + 1 tokens of what it encoded
    check(ev["tokens"] > 0 and ev["tokens"] <= n and n - ev["tokens"] <= 33,
          f"eval encodes the text as the module does ({ev['tokens']} scored of {n} tokens)")

    # 3. Megatron's flags select it.
    r = sh([alloy, "train", "-c", cfg, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model + ".model",
            "--set", "data.tokenizer=byte", "--set", f"output.dir={work}/run-megatron", "--set", "train.steps=1"])
    with open(os.path.join(work, "run-megatron", "config.yaml")) as f:
        written = f.read()
    check('tokenizer: "sentencepiece"' in written and f'tokenizer_model: "{model}.model"' in written and "add_bos: true" in written,
          "--tokenizer-type Llama2Tokenizer --tokenizer-model select SentencePiece, with <s> first as Llama2Tokenizer does")
    # --add-bos: every document starts with <s> (Megatron's Llama2Tokenizer), then ends with </s>.
    sh([alloy, "data", "prepare", "--input", corpus, "--output", os.path.join(work, "data/bos"), "--tokenizer", "sentencepiece",
        "--tokenizer-model", model + ".model", "--valid-fraction", "0.1", "--add-bos"])
    got = read_indexed(os.path.join(work, "data/bos_train"))
    want = [[sp.bos_id()] + sp.encode(d) + [sp.eos_id()] for d in train]
    check(got == want, f"--add-bos starts every document with <s> ({sum(g == w for g, w in zip(got, want))} of {len(want)})")

    # 4. Errors name what is wrong.
    prep = [alloy, "data", "prepare", "--input", corpus, "--output", os.path.join(work, "data/bad"), "--tokenizer", "sentencepiece"]
    r = sh(prep + ["--tokenizer-model", os.path.join(work, "missing.model")], expect_fail=True)
    check("missing.model: no such SentencePiece model file" in r.stderr, f"a missing model is named: {r.stderr.strip()[-120:]}")
    with open(os.path.join(work, "broken.model"), "wb") as f:
        f.write(b"\x00\x01not a model" * 10)
    r = sh(prep + ["--tokenizer-model", os.path.join(work, "broken.model")], expect_fail=True)
    check("broken.model: cannot be loaded by SentencePiece" in r.stderr, f"a damaged model is named: {r.stderr.strip()[-160:]}")
    r = sh(prep + ["--tokenizer-model", model + ".model"], expect_fail=True, env=dict(os.environ, ALLOY_SPM="/bin/true"))
    check("cannot be loaded by SentencePiece" in r.stderr, f"a helper that is not alloy-spm is refused: {r.stderr.strip()[-120:]}")
    r = sh([alloy, "train", "-c", cfg, "--set", "data.tokenizer_model="], expect_fail=True)
    check("data.tokenizer_model" in r.stderr, f"sentencepiece without a model file names the key: {r.stderr.strip()[-120:]}")

    check.finish()


if __name__ == "__main__":
    main()
