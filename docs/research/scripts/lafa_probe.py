"""Issue 64, item 4: a go/no-go probe of a Lafa-style self-speculative drafter for SmolLM2-135M-Instruct.

The drafting model is the frozen target plus a position-masked adapter that acts only on noise rows: LoRA on
q/k/v/o/gate/up/down, RMSNorms modulated per block row (`y * (1 + gamma[j]) + beta[j]`, zero-initialised, the
one-step `tau = 0` form of Lafa's time-conditioned norms), and a learned mask embedding per block row as the noise-row
input (no Gaussian noise: one step from `tau = 0` with a learned constant).

Layout (the LM head's usual shift): with the committed prefix `x_<q` and the bonus `x_q` known from the verify rows, a
block of `B - 1` noise rows sits at positions `q .. q+B-2`; row `j` (1-based) outputs the distribution of `x_{q+j}`, so
the block drafts `x_{q+1} .. x_{q+B-1}` (at most `B` tokens per round). The block sees prefix columns `< q` (base K/V)
and its own rows both ways. This is the issue's layout (rows 1..B at `q .. q+B-1`, row 1 standing for the bonus)
without its last row: the row at `q` (standing for `x_q`) is read as predicting `x_{q+1}`, as the base head does.

Subcommands:
  check                 unit check: a block's logits through the prefix cache == a direct forward of [prefix + block]
                        under the same 4-D mask (adapter on noise rows only), and base rows unchanged.
  throughput            training steps for --seconds, report noise rows/s and sequences/s (--dtype bf16|float32)
  train                 resumable training (checkpoint every --ckpt-minutes under --out), stops after --minutes
  eval                  held-out per-position top-1 and the walk (TPF) for B in {3,4,6}, all or some blocks kept
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 5  # B - 1 for B = 6
TARGET = "smollm2-135m-instruct"
CORPUS = "corpus/smollm2-135m-instruct"
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------------------- adapter
class Ctrl:
    """Which rows of the current forward are noise rows: `row_index` [T] long, block row (0-based) or -1 (base row);
    None means the adapter is off (a plain base forward)."""
    row_index: torch.Tensor | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, ctrl: Ctrl, r: int, alpha: float):
        super().__init__()
        self.base, self.ctrl, self.scale = base, ctrl, alpha / r
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        y = self.base(x)
        idx = self.ctrl.row_index
        if idx is None:
            return y
        d = (x.float() @ self.lora_A.t()) @ self.lora_B.t() * self.scale
        if not bool((idx >= 0).all()):
            d = d * (idx >= 0).to(d.dtype)[None, :, None]
        return y + d.to(y.dtype)


class RowNorm(nn.Module):
    """A base RMSNorm modulated on noise rows by block row `j`: `y * (1 + gamma[j]) + beta[j]`, zero-initialised."""

    def __init__(self, base: nn.Module, ctrl: Ctrl, hidden: int):
        super().__init__()
        self.base, self.ctrl = base, ctrl
        self.gamma = nn.Parameter(torch.zeros(MAX_ROWS, hidden))
        self.beta = nn.Parameter(torch.zeros(MAX_ROWS, hidden))

    def forward(self, x):
        y = self.base(x)
        idx = self.ctrl.row_index
        if idx is None:
            return y
        on = (idx >= 0).float()[:, None]
        j = idx.clamp(min=0)
        g, b = self.gamma[j] * on, self.beta[j] * on
        return (y.float() * (1 + g) + b).to(y.dtype)


class Drafter(nn.Module):
    """The frozen target with the noise-row adapter installed in place (a probe: the package would use hooks)."""

    def __init__(self, target, r: int = 16, alpha: float = 32.0, norms: bool = True):
        super().__init__()
        self.target, self.ctrl = target, Ctrl()
        for p in target.parameters():
            p.requires_grad_(False)
        hidden = target.config.hidden_size
        for layer in target.model.layers:
            for owner in (layer.self_attn, layer.mlp):
                for name in LORA_MODULES:
                    if hasattr(owner, name):
                        setattr(owner, name, LoRALinear(getattr(owner, name), self.ctrl, r, alpha))
            if norms:
                layer.input_layernorm = RowNorm(layer.input_layernorm, self.ctrl, hidden)
                layer.post_attention_layernorm = RowNorm(layer.post_attention_layernorm, self.ctrl, hidden)
        if norms:
            target.model.norm = RowNorm(target.model.norm, self.ctrl, hidden)
        emb = target.model.embed_tokens.weight.detach().float()
        self.mask_embed = nn.Parameter(emb.mean(0, keepdim=True).repeat(MAX_ROWS, 1))

    def trainable(self):
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def adapter_state(self):
        return {n: p.detach().clone() for n, p in self.trainable().items()}

    def load_adapter(self, state):
        own = self.trainable()
        for n, v in state.items():
            own[n].data.copy_(v)

    @torch.no_grad()
    def prefix(self, ids: torch.Tensor):
        """A base forward over `ids` [1, N] into a fresh DynamicCache (adapter off)."""
        self.ctrl.row_index = None
        out = self.target.model(input_ids=ids, use_cache=True)
        return out.cache if hasattr(out, "cache") else out.past_key_values

    def blocks(self, cache, n_prefix: int, qs, sizes, dtype):
        """Hidden states of noise blocks (block k: `sizes[k]` rows at `qs[k] ..`, seeing prefix columns `< qs[k]` and
        itself) after a prefix of `n_prefix` cached tokens. The cache grows by the noise rows: restore it after."""
        row_j, pos, blk = [], [], []
        for k, (q, s) in enumerate(zip(qs, sizes)):
            row_j += list(range(s)); pos += [q + j for j in range(s)]; blk += [k] * s
        row_j = torch.tensor(row_j); pos = torch.tensor(pos); blk = torch.tensor(blk)
        n = len(row_j)
        qcol = torch.tensor(qs)[blk]
        allow = torch.zeros(n, n_prefix + n, dtype=torch.bool)
        allow[:, :n_prefix] = torch.arange(n_prefix)[None, :] < qcol[:, None]
        allow[:, n_prefix:] = blk[:, None] == blk[None, :]
        mask = torch.zeros(n, n_prefix + n, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
        x = self.mask_embed[row_j].to(dtype)[None]
        self.ctrl.row_index = row_j
        try:
            out = self.target.model(inputs_embeds=x, position_ids=pos[None], attention_mask=mask[None, None],
                                    cache=cache, use_cache=True)
        finally:
            self.ctrl.row_index = None
        return out.last_hidden_state[0], row_j, blk


def save_cache(cache):
    return [(l.keys, l.values) for l in cache.layers]


def restore_cache(cache, saved):
    for l, (k, v) in zip(cache.layers, saved):
        l.keys, l.values = k, v


# ------------------------------------------------------------------------------------------------------------- setup
def load(dtype_name: str, threads: int):
    torch.set_num_threads(threads)
    from hf_chainflow.targets import load_target
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    target, tok = load_target(TARGET, dtype=dtype, attn_implementation="sdpa")
    return target, tok, dtype


def sequences(split: str):
    from hf_chainflow.training.corpus import ResponseCorpus
    rows = ResponseCorpus(CORPUS).responses(split)
    return [(rid, rows[rid]["prompt_ids"], rows[rid]["response_ids"]) for rid in sorted(rows)]


# ------------------------------------------------------------------------------------------------------------- check
def cmd_check(args):
    target, tok, dtype = load("float32", args.threads)
    d = Drafter(target)
    g = torch.Generator().manual_seed(0)
    for p in d.trainable().values():  # a non-trivial adapter so that masking errors would show
        p.data.add_(torch.randn(p.shape, generator=g) * 0.02)
    _, p_ids, r_ids = sequences("train")[0]
    ids = torch.tensor(p_ids + r_ids)[:48][None]
    N = ids.shape[1]
    qs, sizes = [30, 36, 44], [2, 3, 5]
    with torch.no_grad():
        cache = d.prefix(ids)
        h_cache, row_j, blk = d.blocks(cache, N, qs, sizes, dtype)
        logits_cache = target.lm_head(h_cache)
        # direct: one forward over [prefix rows | noise rows], base rows causal, the adapter on noise rows only
        n = len(row_j)
        pos = torch.cat([torch.arange(N), torch.tensor([q + j for q, s in zip(qs, sizes) for j in range(s)])])
        allow = torch.zeros(N + n, N + n, dtype=torch.bool)
        allow[:N, :N] = torch.ones(N, N).tril().bool()
        qcol = torch.tensor(qs)[blk]
        allow[N:, :N] = torch.arange(N)[None, :] < qcol[:, None]
        allow[N:, N:] = blk[:, None] == blk[None, :]
        mask = torch.zeros(N + n, N + n).masked_fill(~allow, torch.finfo(torch.float32).min)
        x = torch.cat([target.model.embed_tokens(ids)[0], d.mask_embed[row_j]])[None]
        d.ctrl.row_index = torch.cat([torch.full((N,), -1), row_j])
        out = target.model(inputs_embeds=x, position_ids=pos[None], attention_mask=mask[None, None])
        d.ctrl.row_index = None
        logits_direct = target.lm_head(out.last_hidden_state[0])
        plain = target(input_ids=ids).logits[0]
    diff_noise = (logits_cache - logits_direct[N:]).abs().max().item()
    diff_base = (plain - logits_direct[:N]).abs().max().item()
    print(f"check (float32): noise-row logits, prefix cache vs direct [prefix+blocks] forward: max |diff| {diff_noise:.2e}")
    print(f"check (float32): base-row logits of the direct forward vs a plain forward: max |diff| {diff_base:.2e}")
    ok = diff_noise < 1e-3 and diff_base < 1e-3
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------------------- train
def draw_blocks(rng, P: int, N: int, rows: int):
    """Random blocks over the response: q in [P, N-2], sizes B-1 with B from {3, 4, 6}, until `rows` noise rows."""
    qs, sizes, total = [], [], 0
    while total < rows:
        q = int(rng.integers(P, N - 1))
        s = int(rng.choice([2, 3, 5]))
        qs.append(q); sizes.append(s); total += s
    return qs, sizes


def train_step(d, seq, rng, rows: int, dtype, max_len: int):
    _, p_ids, r_ids = seq
    ids = p_ids + r_ids
    if len(ids) > max_len:  # keep the prompt, cut the response's tail
        ids = ids[:max_len]
    P, N = len(p_ids), len(ids)
    if N - P < 3:
        return None
    qs, sizes = draw_blocks(rng, P, N, rows)
    x = torch.tensor(ids)
    cache = d.prefix(x[None])
    h, row_j, blk = d.blocks(cache, N, qs, sizes, dtype)
    tpos = torch.tensor(qs)[blk] + row_j + 1  # row j (0-based) predicts x_{q+j+1}
    keep = tpos < N
    logits = d.target.lm_head(h[keep]).float()
    loss = F.cross_entropy(logits, x[tpos[keep]])
    acc = (logits.argmax(-1) == x[tpos[keep]]).float().mean().item()
    return loss, acc, len(row_j)


def cmd_train(args):
    target, tok, dtype = load(args.dtype, args.threads)
    d = Drafter(target, r=args.rank, norms=not args.no_norms)
    params = list(d.trainable().values())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    ck = out / "ckpt.pt"
    step, elapsed = 0, 0.0
    if ck.exists() and not args.bench:
        s = torch.load(ck, map_location="cpu")
        d.load_adapter(s["adapter"]); opt.load_state_dict(s["opt"]); step, elapsed = s["step"], s["elapsed"]
        print(f"resumed at step {step}, {elapsed:.0f} s trained", flush=True)
    seqs = sequences("train")
    perm = np.random.default_rng(1234).permutation(len(seqs))
    budget = args.seconds if args.bench else args.minutes * 60
    log = open(out / ("bench.log" if args.bench else "train.log"), "a")
    last_ck, t_mark = time.time(), time.time()
    n_rows = n_seq = 0; losses = []; accs = []; t_bench0 = None
    while elapsed < budget:
        t0 = time.time()
        rng = np.random.default_rng(10_000 + step)
        seq = seqs[perm[step % len(perm)]]
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * max(0.1, 1 - elapsed / (args.minutes * 60))
        for gr in opt.param_groups:
            gr["lr"] = lr
        res = train_step(d, seq, rng, args.rows, dtype, args.max_len)
        step += 1
        if res is None:
            continue
        loss, acc, nr = res
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        dt = time.time() - t0
        elapsed += dt
        if args.bench and t_bench0 is None and step >= 3:  # skip warm-up steps in the rate
            t_bench0, n_rows, n_seq = time.time(), 0, 0
        n_rows += nr; n_seq += 1; losses.append(loss.item()); accs.append(acc)
        if step % args.log_every == 0:
            rec = {"step": step, "elapsed_s": round(elapsed, 1), "lr": lr, "loss": float(np.mean(losses)),
                   "acc": float(np.mean(accs)), "s_per_step": round(dt, 3), "wall": time.strftime("%H:%M:%S")}
            print(json.dumps(rec), file=log, flush=True); print(json.dumps(rec), flush=True)
            losses, accs = [], []
        if not args.bench and time.time() - last_ck > args.ckpt_minutes * 60:
            save_ckpt(ck, d, opt, step, elapsed); last_ck = time.time()
    if args.bench:
        if t_bench0 is None:
            print("THROUGHPUT too slow: fewer than 4 steps in the budget", flush=True); return
        wall = time.time() - t_bench0
        rec = {"dtype": args.dtype, "threads": args.threads, "rows_per_step": args.rows, "steps": n_seq,
               "wall_s": round(wall, 1), "noise_rows_per_s": round(n_rows / wall, 1),
               "sequences_per_s": round(n_seq / wall, 3), "s_per_step": round(wall / n_seq, 3)}
        print("THROUGHPUT", json.dumps(rec), flush=True); print(json.dumps(rec), file=log, flush=True)
    else:
        save_ckpt(ck, d, opt, step, elapsed)
        print(f"done: step {step}, {elapsed:.0f} s", flush=True)


def save_ckpt(path: Path, d, opt, step, elapsed):
    tmp = path.with_suffix(".tmp")
    torch.save({"adapter": d.adapter_state(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    os.replace(tmp, path)
    torch.save({"adapter": d.adapter_state(), "step": step, "elapsed": elapsed},
               path.parent / f"adapter-step{step:06d}.pt")


# -------------------------------------------------------------------------------------------------------------- eval
def heldout_subset(n: int, seed: int = 0):
    seqs = sequences("heldout")
    idx = np.random.default_rng(seed).choice(len(seqs), size=n, replace=False)  # random order: any first K is a sample
    return [seqs[i] for i in idx]


def walk(x, P, drafts, B, keep):
    """Tokens and rounds of the walk over response positions; `drafts[q]` = B-1 drafted ids for x_{q+1..}.
    keep: set of accepted lengths whose candidate block the fused forward carries (None = all). A round whose
    accepted length has no block is followed by a round without a draft (1 token, 1 + (B-1) rows: it carries the
    block for accepted length 0). Returns tokens, rounds, rows (sum of fused-forward rows), accepted histogram."""
    N = len(x)
    q, tokens, rounds, rows, has_draft = P, 0, 0, 0, True
    hist = np.zeros(B, dtype=np.int64)
    nblk = B if keep is None else len(keep)
    while q < N - 1:
        if has_draft:
            d = drafts[q]
            a = 0
            while a < B - 1 and q + a + 1 < N and d[a] == x[q + a + 1]:
                a += 1
            hist[a] += 1
            rows += B + nblk * (B - 1)
            has_draft = keep is None or a in keep
        else:
            a = 0
            rows += 1 + (B - 1)
            has_draft = True
        tokens += min(a + 1, N - 1 - q)
        rounds += 1
        q += a + 1
    return tokens, rounds, rows, hist


@torch.no_grad()
def cmd_eval(args):
    target, tok, dtype = load(args.dtype, args.threads)
    d = Drafter(target, r=args.rank, norms=not args.no_norms)
    step = 0
    if args.ckpt:
        s = torch.load(args.ckpt, map_location="cpu")
        d.load_adapter(s["adapter"]); step = s.get("step", 0)
    Bs = [int(b) for b in args.B.split(",")]
    seqs = heldout_subset(args.n, args.seed)[: args.limit]
    correct = {B: np.zeros(B - 1) for B in Bs}; count = {B: np.zeros(B - 1) for B in Bs}
    keeps = {}
    for B in Bs:
        ks = {"all": None, "{0}": {0}, "{0,B-1}": {0, B - 1}, "{0,1}": {0, 1}, "{0,1,B-1}": {0, 1, B - 1}}
        if B >= 4:
            ks["{0,1,2}"] = {0, 1, 2}
        keeps[B] = ks
    agg = {B: {k: [0, 0, 0, np.zeros(B, dtype=np.int64)] for k in keeps[B]} for B in Bs}
    t0 = time.time()
    for i, (rid, p_ids, r_ids) in enumerate(seqs):
        ids = (p_ids + r_ids)[: args.max_len]
        P, N = len(p_ids), len(ids)
        if N - P < 2:
            continue
        x = torch.tensor(ids)
        cache = d.prefix(x[None]); saved = save_cache(cache)
        for B in Bs:
            s = B - 1
            qs_all = list(range(P, N - 1))
            drafts = {}
            per = max(1, args.chunk_rows // s)
            for c in range(0, len(qs_all), per):
                qs = qs_all[c:c + per]
                h, row_j, blk = d.blocks(cache, N, qs, [s] * len(qs), dtype)
                restore_cache(cache, saved)
                pred = target.lm_head(h).argmax(-1).view(len(qs), s)
                for k, q in enumerate(qs):
                    drafts[q] = pred[k].tolist()
                    for j in range(s):
                        if q + j + 1 < N:
                            count[B][j] += 1; correct[B][j] += int(pred[k, j].item() == ids[q + j + 1])
            for name, keep in keeps[B].items():
                t, r, rw, hist = walk(ids, P, drafts, B, keep)
                a = agg[B][name]; a[0] += t; a[1] += r; a[2] += rw; a[3] += hist
        if (i + 1) % 10 == 0 or i + 1 == len(seqs):
            print(f"{i + 1}/{len(seqs)} responses, {time.time() - t0:.0f} s; TPF all:",
                  {B: round(agg[B]["all"][0] / agg[B]["all"][1], 3) for B in Bs}, flush=True)
            write_eval(args, step, i + 1, t0, Bs, correct, count, agg)


def write_eval(args, step, done, t0, Bs, correct, count, agg):
    """Results so far (the first `done` responses of the subset), rewritten every 10 responses."""
    res = {"ckpt": args.ckpt, "step": step, "dtype": args.dtype, "n_subset": args.n, "n_responses": done,
           "seed": args.seed, "eval_s": round(time.time() - t0, 1), "B": {}}
    for B in Bs:
        res["B"][str(B)] = {
            "top1_per_row": (correct[B] / count[B]).round(4).tolist(), "positions": int(count[B][0]),
            "walk": {name: {"TPF": round(a[0] / a[1], 4), "rounds": int(a[1]), "tokens": int(a[0]),
                            "mean_rows_per_forward": round(a[2] / a[1], 2),
                            "accepted_hist": a[3].tolist()} for name, a in agg[B].items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        Path(args.out).with_name(Path(args.out).stem + f"-first{done}.json").write_text(json.dumps(res, indent=1))


# ------------------------------------------------------------------------------------------------------------ report
def cost_at(cost: dict, rows: float, series: str, key: str = "steps_median") -> float:
    """Cost (in 1-row steps) of a fused forward of `rows` rows, interpolated linearly over the measured row counts of
    one series ("base": the target's forward alone; "adapter": with the probe's eager noise-row adapter), clamped at
    the ends."""
    pts = sorted((int(k[1:].split("-")[0]), v[key]) for k, v in cost["rows"].items() if k.endswith("-" + series))
    return float(np.interp(rows, [n for n, _ in pts], [c for _, c in pts]))


def cmd_report(args):
    zero = json.loads(Path(args.zero).read_text()); trained = json.loads(Path(args.trained).read_text())
    cost = json.loads(Path(args.cost).read_text()) if args.cost else None
    out = []
    out.append(f"Per-position top-1 on {trained['n_responses']} held-out responses "
               f"({trained['B']['3']['positions']} positions), zero-initialised adapter / trained (step {trained['step']}):\n")
    out.append("| B | " + " | ".join(f"row {j} (x_q+{j})" for j in range(1, MAX_ROWS + 1)) + " |")
    out.append("|---|" + "---|" * MAX_ROWS)
    for B in sorted(trained["B"], key=int):
        z = zero["B"][B]["top1_per_row"]; t = trained["B"][B]["top1_per_row"]
        cells = [f"{100 * z[j]:.1f} / **{100 * t[j]:.1f}**" if j < len(t) else "" for j in range(MAX_ROWS)]
        out.append(f"| {B} | " + " | ".join(cells) + " |")
    out.append("")
    head = "| B | blocks kept (accepted lengths) | rows per fused forward (with draft) | TPF zero-init | TPF trained"
    if cost:
        head += (" | c: forward alone (steps) | TPF / c | TPF for 1.5x (1.5 c) | c: with the eager adapter | TPF / c")
    out.append(head + " |")
    out.append("|---" * (head.count("|") - 1) + "|")
    for B in sorted(trained["B"], key=int):
        b = int(B)
        for name, w in trained["B"][B]["walk"].items():
            nblk = b if name == "all" else len(name.strip("{}").split(","))
            rows_d = b + nblk * (b - 1)
            zt = zero["B"][B]["walk"][name]["TPF"]
            line = f"| {B} | {name} | {rows_d} | {zt:.3f} | **{w['TPF']:.3f}**"
            if cost:
                # rounds with a draft carry rows_d rows; rounds without one carry B rows (1 verify + one block)
                R = w["rounds"]; tot = w["mean_rows_per_forward"] * R
                n_nd = round((rows_d * R - tot) / (rows_d - b)) if rows_d != b else 0
                cs = []
                for series in ("base", "adapter"):
                    cs.append(((R - n_nd) * cost_at(cost, rows_d, series) + n_nd * cost_at(cost, b, series)) / R)
                line += (f" | {cs[0]:.2f} | {w['TPF'] / cs[0]:.2f} | {1.5 * cs[0]:.2f} | {cs[1]:.2f} | "
                         f"{w['TPF'] / cs[1]:.2f}")
            out.append(line + " |")
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        if args.log:
            recs = [json.loads(l) for l in Path(args.log).read_text().splitlines() if l.strip()]
            st = [r["step"] for r in recs]
            ax[0].plot(st, [r["loss"] for r in recs], label="loss (rows 1..B-1)")
            ax2 = ax[0].twinx(); ax2.plot(st, [r["acc"] for r in recs], color="C1", label="train top-1")
            ax2.set_ylabel("train top-1 (all rows)"); ax[0].set_xlabel("step (one sequence, 256 noise rows)")
            ax[0].set_ylabel("cross-entropy"); ax[0].set_title("training (bf16, 1 thread)")
        for k, B in enumerate(sorted(trained["B"], key=int)):
            t = trained["B"][B]["top1_per_row"]; z = zero["B"][B]["top1_per_row"]
            ax[1].plot(range(1, len(t) + 1), t, "o-", color=f"C{k}", label=f"B={B} trained")
            ax[1].plot(range(1, len(z) + 1), z, "x:", color=f"C{k}", label=f"B={B} zero-init")
        ax[1].axhline(0.38, color="gray", ls="--", lw=1); ax[1].text(1, 0.39, "shipped drafter, 1st token", fontsize=7)
        ax[1].set_xlabel("block row j (drafts x_{q+j})"); ax[1].set_ylabel("held-out top-1"); ax[1].legend(fontsize=7)
        ax[1].set_title("per-position top-1, held out")
        fig.tight_layout(); fig.savefig(args.plot, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("check", "throughput", "train", "eval"):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--dtype", default="bf16", choices=["bf16", "float32"])
        p.add_argument("--rank", type=int, default=16)
        p.add_argument("--no-norms", action="store_true", help="no row-conditioned norms")
        p.add_argument("--max-len", type=int, default=768)
        if name in ("throughput", "train"):
            p.add_argument("--out", default="runs/lafa-probe/run")
            p.add_argument("--rows", type=int, default=256, help="noise rows per step (one sequence)")
            p.add_argument("--lr", type=float, default=3e-4)
            p.add_argument("--warmup", type=int, default=50)
            p.add_argument("--minutes", type=float, default=50)
            p.add_argument("--seconds", type=float, default=90)
            p.add_argument("--ckpt-minutes", type=float, default=5)
            p.add_argument("--log-every", type=int, default=10)
            p.set_defaults(bench=name == "throughput")
        if name == "eval":
            p.add_argument("--ckpt", default=None, help="adapter checkpoint; none = zero-initialised (the base)")
            p.add_argument("--n", type=int, default=150)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--B", default="3,4,6")
            p.add_argument("--chunk-rows", type=int, default=400)
            p.add_argument("--limit", type=int, default=None, help="only the first LIMIT responses of the subset")
            p.add_argument("--out", default=None)
    p = sub.add_parser("report")
    p.add_argument("--zero", required=True); p.add_argument("--trained", required=True)
    p.add_argument("--cost", default=None); p.add_argument("--log", default=None)
    p.add_argument("--out", default=None); p.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    fn = {"check": cmd_check, "throughput": cmd_train, "train": cmd_train, "eval": cmd_eval,
          "report": cmd_report}[args.cmd]
    return fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
