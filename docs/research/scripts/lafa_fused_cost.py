"""Issue 64, item 4: the cost of one fused Lafa-style forward of `n` new rows after a ~200-token prefix, relative to a
plain 1-row decoding step, SmolLM2-135M-Instruct in bfloat16 on the CPU.

For each `n`: the base forward of `n` rows under a 4-D additive mask (the first `v` rows causal "verify" rows, the
rest noise rows), and the same with the probe's noise-row adapter on (LoRA r=16 on q/k/v/o/gate/up/down and
row-conditioned norms, masked to the noise rows), both with the LM head over all `n` rows. Calls are interleaved
round-robin, `--repeats` times; min and median per configuration, each divided by the 1-row step's min / median.

    python docs/research/scripts/lafa_fused_cost.py --threads 2 --repeats 15 --out cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from lafa_probe import Drafter, load, restore_cache, save_cache, sequences  # noqa: E402

# (n rows, verify rows): B=3 all 9 / some 7; B=4 all 16 / some 13; B=6 all 36 / some 21; the layout
# (B + B*B): 12, 20, 42
SHAPES = [(1, 1), (2, 2), (4, 4), (7, 3), (9, 3), (12, 3), (13, 4), (16, 4), (20, 4), (21, 6), (36, 6), (42, 6)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target, tok, dtype = load("bf16", args.threads)
    d = Drafter(target)
    g = torch.Generator().manual_seed(0)
    for p in d.trainable().values():
        p.data.add_(torch.randn(p.shape, generator=g) * 0.01)
    ids = next(p + r for _, p, r in sequences("heldout") if len(p) + len(r) >= args.prefix + 50)
    x = torch.tensor(ids)
    N = args.prefix
    with torch.no_grad():
        cache = d.prefix(x[None, :N])
        saved = save_cache(cache)

        def step1():
            target(input_ids=x[None, N:N + 1], cache=cache, use_cache=True)

        def fused(n, v, adapter):
            s = n - v
            pos = torch.arange(N, N + n)[None]
            allow = torch.zeros(n, N + n, dtype=torch.bool)
            allow[:, :N] = True
            allow[:v, N:N + v] = torch.ones(v, v).tril().bool()
            allow[v:, N:N + v] = True  # candidate blocks see verify rows (which ones does not change the cost)
            allow[v:, N + v:] = True
            mask = torch.zeros(n, N + n, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)[None, None]
            emb = target.model.embed_tokens(x[None, N:N + v])
            if s:
                emb = torch.cat([emb, d.mask_embed[torch.arange(s) % 5].to(dtype)[None]], 1)
            if adapter:
                d.ctrl.row_index = torch.cat([torch.full((v,), -1), torch.arange(s) % 5])
            try:
                out = target.model(inputs_embeds=emb, position_ids=pos, attention_mask=mask, cache=cache,
                                   use_cache=True)
                target.lm_head(out.last_hidden_state)
            finally:
                d.ctrl.row_index = None

        configs = [("step1", step1)] + [(f"n{n}-base", (lambda n=n, v=v: fused(n, v, False))) for n, v in SHAPES] \
            + [(f"n{n}-adapter", (lambda n=n, v=v: fused(n, v, True))) for n, v in SHAPES if n > v]
        times = {name: [] for name, _ in configs}
        for _ in range(3):  # warm-up
            for name, fn in configs:
                fn(); restore_cache(cache, saved)
        for _ in range(args.repeats):
            for name, fn in configs:
                t0 = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t0)
                restore_cache(cache, saved)
    mn1, md1 = min(times["step1"]), float(np.median(times["step1"]))
    res = {"threads": args.threads, "prefix": N, "repeats": args.repeats, "dtype": "bfloat16",
           "step1_ms": {"min": round(mn1 * 1e3, 2), "median": round(md1 * 1e3, 2)}, "rows": {}}
    for name, ts in times.items():
        if name == "step1":
            continue
        res["rows"][name] = {"min_ms": round(min(ts) * 1e3, 2), "median_ms": round(float(np.median(ts)) * 1e3, 2),
                             "steps_min": round(min(ts) / mn1, 3), "steps_median": round(float(np.median(ts)) / md1, 3)}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
