#!/usr/bin/python3
"""PEFT layout round trip: Alloy's LoRA adapters, read by PEFT's names, reproduce Alloy's outputs.

For GPT-2 (Conv1D weights, fan_in_fan_out) and LLaMA (grouped-query attention, kv_heads 2) a base
is pretrained for a few steps and exported as HuggingFace safetensors + config.json; a LoRA run
fine-tunes it (--init-from the exported file) and writes OUTPUT/adapter/ in PEFT's layout. This
test then works from those files alone, the way a PEFT user would:

  layout        every adapter key is base_model.model.<module>.lora_{A,B}.weight for a projection
                of the HF model, A [r, in] and B [out, r] by the config, both present, B nonzero
  config        adapter_config.json: peft_type LORA, r, lora_alpha, fan_in_fan_out (true for
                gpt2 only), bias none, task_type, base path; its target_modules select, by PEFT's
                rule (exact name or dotted suffix of a module's name), exactly the adapted modules
  eval-loss     an independent LoRA forward (float64: frozen base projection plus
                (alpha/r) * (x A^T) B^T on the side, never merged) gives `alloy eval`'s loss of the
                LoRA checkpoint on a text file within 1e-5 relative, and equals reference.py's
                model on the Python-merged weights
  merge         `alloy export --merge` equals W + (alpha/r) * delta (delta = (B A)^T for Conv1D,
                B A for Linear) within 1e-6, every other tensor the base's own
  merged-eval   `alloy eval` of the merged export gives the same loss
  control       the base alone (and the adapters at scale 1 instead of alpha/r) is far from
                Alloy's LoRA loss, and Alloy's own eval of the base agrees with Python's base

usage: test_peft.py ALLOY WORKDIR
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "dist"))
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from distlib import fresh_workdir_with_corpus, sh  # noqa: E402
import st  # noqa: E402
from reference import (_causal_attention, _gelu_new, _rms_norm, _rotate_half, loss_fn,  # noqa: E402
                       parse_config, rel_error, rope_cos_sin)

RTOL_LOSS = 1e-5     # Alloy (float32) against the float64 reference
TOL_MERGE = 1e-6     # merged weights: norm-relative and max absolute
CONTROL_GAP = 10     # the negative controls must miss Alloy's loss by this many tolerances
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
SEQ = 32
PREFIX = "base_model.model."

# arch: (model line of the config, --lora-targets). GPT-2 adapts c_attn and the MLP but not
# attn.c_proj, so target_modules must tell the two c_proj apart; LLaMA adapts everything.
ARCHS = {
    "gpt2": ("arch: gpt2, layers: 3, hidden: 32, heads: 4", ["c_attn", "mlp.*"]),
    "llama": ("arch: llama, layers: 3, hidden: 32, heads: 4, kv_heads: 2", ["all"]),
}


def config(work, arch, out):
    path = os.path.join(work, f"{arch}.yaml")
    with open(path, "w") as f:
        f.write(f"""model: {{{ARCHS[arch][0]}, seq_len: {SEQ}, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: 10, global_batch: 8, lr: 5e-3, warmup: 2, eval_interval: 0, eval_batches: 1, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


# --------------------------------------------------------------------------------------------
# The HF model's modules, as PEFT sees them (named_modules of GPT2LMHeadModel / LlamaForCausalLM)
# --------------------------------------------------------------------------------------------

def projections(cfg):
    """{module name: (in_features, out_features)} of every linear projection inside the blocks."""
    H, F_, hd = cfg.hidden, cfg.ffn, cfg.head_dim
    out = {}
    for i in range(cfg.layers):
        if cfg.arch == "gpt2":
            p = f"transformer.h.{i}."
            out.update({p + "attn.c_attn": (H, 3 * H), p + "attn.c_proj": (H, H),
                        p + "mlp.c_fc": (H, F_), p + "mlp.c_proj": (F_, H)})
        else:
            p = f"model.layers.{i}."
            out.update({p + "self_attn.q_proj": (H, cfg.heads * hd), p + "self_attn.k_proj": (H, cfg.kv_heads * hd),
                        p + "self_attn.v_proj": (H, cfg.kv_heads * hd), p + "self_attn.o_proj": (cfg.heads * hd, H),
                        p + "mlp.gate_proj": (H, F_), p + "mlp.up_proj": (H, F_), p + "mlp.down_proj": (F_, H)})
    return out


def all_modules(cfg):
    """Every named module (containers, norms, embeddings and the head too): what PEFT matches against."""
    names = set(projections(cfg)) | {"lm_head"}
    for i in range(cfg.layers):
        if cfg.arch == "gpt2":
            p = f"transformer.h.{i}"
            names |= {p, p + ".ln_1", p + ".attn", p + ".attn.attn_dropout", p + ".attn.resid_dropout",
                      p + ".ln_2", p + ".mlp", p + ".mlp.act", p + ".mlp.dropout"}
        else:
            p = f"model.layers.{i}"
            names |= {p, p + ".self_attn", p + ".self_attn.rotary_emb", p + ".mlp", p + ".mlp.act_fn",
                      p + ".input_layernorm", p + ".post_attention_layernorm"}
    if cfg.arch == "gpt2":
        names |= {"transformer", "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h",
                  "transformer.ln_f"}
    else:
        names |= {"model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb"}
    return names


def peft_selects(module, target_modules):
    """PEFT's check_target_module_exists for a list: the exact name or a dotted suffix of it."""
    return module in target_modules or any(module.endswith("." + t) for t in target_modules)


def weight_name(cfg, module):
    """The HF checkpoint's tensor for a module's weight (GPT-2 files carry no `transformer.`)."""
    if cfg.arch == "gpt2":
        assert module.startswith("transformer.")
        module = module[len("transformer."):]
    return module + ".weight"


# --------------------------------------------------------------------------------------------
# Reading the adapter by PEFT's names
# --------------------------------------------------------------------------------------------

def read_adapters(cfg, path):
    """{module: (A [r, in], B [out, r])} in float64, and the problems found on the way."""
    tensors, _ = st.load(path)
    shapes = projections(cfg)
    halves, errs = {}, []
    for key, t in sorted(tensors.items()):
        suffix = next((s for s in (".lora_A.weight", ".lora_B.weight") if key.endswith(s)), None)
        if not key.startswith(PREFIX) or suffix is None:
            errs.append(f"{key}: not {PREFIX}<module>.lora_{{A,B}}.weight")
            continue
        module = key[len(PREFIX):-len(suffix)]
        if module not in shapes:
            errs.append(f"{key}: {module} is no projection of the HF {cfg.arch} model")
            continue
        fan_in, fan_out = shapes[module]
        want = [RANK, fan_in] if suffix == ".lora_A.weight" else [fan_out, RANK]
        if list(t.shape) != want or not t.is_floating_point():
            errs.append(f"{key}: {t.dtype} {list(t.shape)}, expected floating {want}")
            continue
        halves.setdefault(module, {})[suffix[6]] = t.to(torch.float64)
    adapters = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            errs.append(f"{module}: only lora_{''.join(ab)}")
        else:
            adapters[module] = (ab["A"], ab["B"])
    return adapters, errs


def delta(cfg, A, B):
    """The adapter's update in the base weight's own layout: Conv1D [in, out], Linear [out, in]."""
    return (B @ A).t() if cfg.arch == "gpt2" else B @ A


def merge(cfg, base, adapters, scale):
    merged = dict(base)
    for module, (A, B) in adapters.items():
        n = weight_name(cfg, module)
        merged[n] = base[n] + scale * delta(cfg, A, B)
    return merged


# --------------------------------------------------------------------------------------------
# The LoRA forward: frozen base projections, adapters on the side (never merged)
# --------------------------------------------------------------------------------------------

def lora_logits(cfg, p, adapters, scale, idx):
    def proj(module, x):
        w = p[weight_name(cfg, module)]
        if cfg.arch == "gpt2":  # Conv1D: x @ W + b, W [in, out]
            y = x @ w + p[weight_name(cfg, module)[:-len("weight")] + "bias"]
        else:                   # Linear: x @ W^T, W [out, in]
            y = x @ w.t()
        if module in adapters:
            A, B = adapters[module]
            y = y + scale * ((x @ A.t()) @ B.t())
        return y

    B_, T = idx.shape
    H, nh, nkv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    if cfg.arch == "gpt2":
        x = p["wte.weight"][idx] + p["wpe.weight"][torch.arange(T)]
        for i in range(cfg.layers):
            pre, m = f"h.{i}.", f"transformer.h.{i}."
            h = F.layer_norm(x, (H,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], cfg.eps)
            q, k, v = proj(m + "attn.c_attn", h).split(H, dim=-1)
            q, k, v = (t.view(B_, T, nh, hd).transpose(1, 2) for t in (q, k, v))
            a = _causal_attention(q, k, v).transpose(1, 2).reshape(B_, T, H)
            x = x + proj(m + "attn.c_proj", a)
            h = F.layer_norm(x, (H,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], cfg.eps)
            x = x + proj(m + "mlp.c_proj", _gelu_new(proj(m + "mlp.c_fc", h)))
        x = F.layer_norm(x, (H,), p["ln_f.weight"], p["ln_f.bias"], cfg.eps)
        return x @ p["wte.weight"].t()
    cos, sin = rope_cos_sin(T, hd, cfg.rope_theta, torch.float64)
    x = p["model.embed_tokens.weight"][idx]
    for i in range(cfg.layers):
        m = f"model.layers.{i}."
        h = _rms_norm(x, p[m + "input_layernorm.weight"], cfg.eps)
        q = proj(m + "self_attn.q_proj", h).view(B_, T, nh, hd).transpose(1, 2)
        k = proj(m + "self_attn.k_proj", h).view(B_, T, nkv, hd).transpose(1, 2)
        v = proj(m + "self_attn.v_proj", h).view(B_, T, nkv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        a = _causal_attention(q, k, v).transpose(1, 2).reshape(B_, T, nh * hd)
        x = x + proj(m + "self_attn.o_proj", a)
        h = _rms_norm(x, p[m + "post_attention_layernorm.weight"], cfg.eps)
        x = x + proj(m + "mlp.down_proj", F.silu(proj(m + "mlp.gate_proj", h)) * proj(m + "mlp.up_proj", h))
    return _rms_norm(x, p["model.norm.weight"], cfg.eps) @ p["lm_head.weight"].t()


def lora_loss(cfg, base, adapters, scale, windows):
    logits = lora_logits(cfg, base, adapters, scale, windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


def eval_windows(text):
    """`alloy eval`'s windows: bytes are tokens, windows of SEQ+1 start at 0, SEQ, 2 SEQ, ..."""
    ids = list(text)
    n = (len(ids) - 1) // SEQ
    return torch.tensor([ids[w * SEQ:w * SEQ + SEQ + 1] for w in range(n)], dtype=torch.long)


def rel(a, b):
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------------------------

def run_arch(alloy, work, arch, env, text_path, windows, report):
    targets = ARCHS[arch][1]
    pre = os.path.join(work, f"{arch}-pretrained")
    yaml = config(work, arch, pre)
    sh([alloy, "train", "--config", yaml], env=env)
    base_path = os.path.join(work, f"{arch}-base", "model.safetensors")
    sh([alloy, "export", "--checkpoint", pre, "-o", base_path], env=env)
    run = os.path.join(work, f"{arch}-lora")
    sh([alloy, "train", "--config", yaml, "--set", f"output.dir={run}", "--init-from", base_path,
        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets"] + targets +
       ["--set", "train.lr=1e-2", "--set", "train.steps=20"], env=env)
    merged_path = os.path.join(work, f"{arch}-merged", "model.safetensors")
    sh([alloy, "export", "--checkpoint", run, "--merge", "-o", merged_path], env=env)

    def alloy_eval(weights):
        r = sh([alloy, "eval", "-c", yaml, "-w", weights, "--text", text_path, "--threads", "1"], env=env)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        if out["tokens"] != windows.numel() - windows.shape[0]:
            raise AssertionError(f"alloy eval scored {out['tokens']} tokens, expected {windows.shape[0]} windows "
                                 f"of {SEQ}")
        return out["loss"]

    # From here on only the exported base, its config.json and the adapter directory are read.
    with open(os.path.join(os.path.dirname(base_path), "config.json")) as f:
        cfg = parse_config(json.load(f))
    base = {n: t.to(torch.float64) for n, t in st.load(base_path)[0].items()}
    adapter_dir = os.path.join(run, "adapter")
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        acfg = json.load(f)
    adapters, errs = read_adapters(cfg, os.path.join(adapter_dir, "adapter_model.safetensors"))
    ckpt = os.path.join(run, "checkpoints", "step_00000020")

    def check(name, fn):
        try:
            ok, msg = fn()
        except Exception as e:  # a missing key or file is this check's failure, not the test's end
            ok, msg = False, f"{type(e).__name__}: {e}"
        report(ok, f"{arch:<6} {name:<12} {msg}")

    def layout():
        problems = list(errs)
        zero_b = [m for m, (_, B) in adapters.items() if not B.abs().max().item() > 0]
        if zero_b:
            problems.append(f"lora_B still zero after training: {zero_b[:3]}")
        for m in adapters:  # the base agrees: Conv1D [in, out], Linear [out, in]
            fan_in, fan_out = projections(cfg)[m]
            have = list(base[weight_name(cfg, m)].shape)
            if have != ([fan_in, fan_out] if arch == "gpt2" else [fan_out, fan_in]):
                problems.append(f"{m}: base weight {have} disagrees with the config")
        if not adapters:
            problems.append("no adapters")
        return not problems, (f"{len(adapters)} adapted modules, {2 * len(adapters)} tensors "
                              f"{PREFIX}<module>.lora_{{A [{RANK}, in], B [out, {RANK}]}}.weight" if not problems
                              else "; ".join(problems[:6]))

    def peft_config():
        want = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "fan_in_fan_out": arch == "gpt2",
                "bias": "none", "task_type": "CAUSAL_LM"}
        problems = [f"{k}={acfg.get(k)!r} (expected {v!r})" for k, v in want.items() if acfg.get(k) != v]
        for k in ("use_rslora", "use_dora"):  # either would change the math modelled here
            if acfg.get(k, False):
                problems.append(f"{k}={acfg[k]!r}")
        if acfg.get("lora_dropout", 0.0) != 0.0:
            problems.append(f"lora_dropout={acfg['lora_dropout']!r} (the run used none)")
        if acfg.get("rank_pattern") or acfg.get("alpha_pattern"):
            problems.append("rank_pattern/alpha_pattern set (one rank and alpha were used)")
        if not os.path.exists(str(acfg.get("base_model_name_or_path"))) or \
                not os.path.samefile(acfg["base_model_name_or_path"], base_path):
            problems.append(f"base_model_name_or_path={acfg.get('base_model_name_or_path')!r}, "
                            f"expected {base_path}")
        tm = acfg.get("target_modules")
        if not isinstance(tm, list) or not all(isinstance(t, str) for t in tm):
            problems.append(f"target_modules={tm!r} (expected a list of names)")
            tm = []
        selected = {m for m in all_modules(cfg) if peft_selects(m, tm)}
        if selected != set(adapters):
            problems.append(f"target_modules {tm} select {sorted(selected - set(adapters))[:4]} without adapters "
                            f"and miss {sorted(set(adapters) - selected)[:4]}")
        kinds = sorted({m.split(".", 3)[-1] for m in adapters})  # transformer.h.0.X, model.layers.0.X
        return not problems, (f"target_modules {tm} select exactly the adapted {kinds}" if not problems
                              else "; ".join(problems))

    results = {}

    def eval_loss():
        py = lora_loss(cfg, base, adapters, SCALE, windows)
        py_merged = loss_fn(cfg, merge(cfg, base, adapters, SCALE), windows).item()
        got = alloy_eval(ckpt)
        results.update(py=py, alloy=got)
        ok = rel(got, py) <= RTOL_LOSS and rel(py_merged, py) <= 1e-10
        return ok, (f"alloy eval {got:.9f}, Python LoRA forward {py:.9f}: relative {rel(got, py):.2e} "
                    f"(tolerance {RTOL_LOSS:g}); reference.py on merged weights {rel(py_merged, py):.1e} apart "
                    f"({windows.shape[0]} windows)")

    def merged():
        mine = merge(cfg, base, adapters, SCALE)
        theirs, _ = st.load(merged_path)
        problems = []
        if set(theirs) != set(base):
            problems.append(f"names differ from the base's: extra {sorted(set(theirs) - set(base))[:3]}, "
                            f"missing {sorted(set(base) - set(theirs))[:3]}")
        worst_rel = worst_abs = 0.0
        adapted = {weight_name(cfg, m) for m in adapters}
        for n in sorted(set(theirs) & set(base)):
            if list(theirs[n].shape) != list(base[n].shape):
                problems.append(f"{n}: {list(theirs[n].shape)} vs base {list(base[n].shape)}")
                continue
            if n in adapted:
                r, a, _ = rel_error(theirs[n], mine[n])
                worst_rel, worst_abs = max(worst_rel, r), max(worst_abs, a)
                if not (r <= TOL_MERGE and a <= TOL_MERGE):
                    problems.append(f"{n}: relative {r:.2e}, max abs {a:.2e}")
            elif not torch.equal(theirs[n].to(torch.float64), base[n]):
                problems.append(f"{n}: not adapted yet differs from the base")
        with open(os.path.join(os.path.dirname(merged_path), "config.json")) as f:
            if parse_config(json.load(f)).__dict__ != cfg.__dict__:
                problems.append("merged config.json differs from the base's")
        return not problems, (f"{len(adapted)} merged weights within {TOL_MERGE:g} (worst relative "
                              f"{worst_rel:.1e}, max abs {worst_abs:.1e}), the other {len(base) - len(adapted)} "
                              f"tensors the base's own" if not problems else "; ".join(problems[:6]))

    def merged_eval():
        got = alloy_eval(merged_path)
        py = results["py"]
        return rel(got, py) <= RTOL_LOSS, f"alloy eval of the merged export {got:.9f}: relative {rel(got, py):.2e}"

    def control():
        target = results["alloy"]
        py_base = lora_loss(cfg, base, {}, SCALE, windows)
        unscaled = lora_loss(cfg, base, adapters, 1.0, windows)
        alloy_base = alloy_eval(base_path)
        gap_base, gap_unscaled = rel(py_base, target), rel(unscaled, target)
        ok = (gap_base >= CONTROL_GAP * RTOL_LOSS and gap_unscaled >= CONTROL_GAP * RTOL_LOSS
              and rel(alloy_base, py_base) <= RTOL_LOSS)
        return ok, (f"base alone {py_base:.6f} misses Alloy's LoRA loss by {gap_base:.1e}, adapters at scale 1 "
                    f"by {gap_unscaled:.1e} (need >= {CONTROL_GAP * RTOL_LOSS:g}); alloy eval of the base "
                    f"{rel(alloy_base, py_base):.1e} from Python's")

    check("layout", layout)
    check("config", peft_config)
    check("eval-loss", eval_loss)
    check("merge", merged)
    check("merged-eval", merged_eval)
    check("control", control)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    torch.set_num_threads(1)
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # 40 windows and a partial one Alloy must leave out.
    with open(os.path.join(work, "corpus.txt"), "rb") as f:
        text = f.read()[-(40 * SEQ + 1 + 19):]
    text_path = os.path.join(work, "eval.txt")
    with open(text_path, "wb") as f:
        f.write(text)
    windows = eval_windows(text)

    tally = [0, 0]

    def report(ok, line):
        tally[0 if ok else 1] += 1
        print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)

    for arch in ARCHS:
        run_arch(alloy, work, arch, env, text_path, windows, report)
    print(f"{tally[0]} passed, {tally[1]} failed")
    return 1 if tally[1] else 0


if __name__ == "__main__":
    sys.exit(main())
