"""Does a drafter's one-step velocity overshoot? Scale the Euler step by alpha and measure, on held-out windows, the
decoded states' relative error by depth and the offline and walk tau (a serving-time diagnostic; nothing here
changes how a drafter serves).

The shipped drafters are trained with `train_flow_steps=2` (`L_hid` on the halfway and the final decoded state of
a two-step trajectory, plus the path-corrected state) and served with one step. If the halfway state is pulled
onto the target, the first velocity is pulled toward twice the transport, and one full step overshoots: a scale
alpha < 1 would then predict better.

    python docs/research/scripts/flow_step_scale.py runs/heldout/data --threads 1 --out docs/research/results/flow-step-scale/scan.json

`runs/heldout/data`: the target's responses to 64 training prompts no drafter was trained on (8 a domain,
`docs/research/scripts/select_training_prompts.py --per-domain 8 --seed 3030`, excluding the shared responses and the rounds of
seeds 2026 and 2027), prepared with `hf-chainflow prepare --prompts ... --shard-size 64 --dtype float32`.
"""

import argparse
import json

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation.serving import serving_velocity
from hf_chainflow.cli import load_model_and_tokenizer
from hf_chainflow.cli_train import _window_dataset
from hf_chainflow.training.evaluation import evaluate_offline

SETTINGS = [(1, 1.0), (1, 0.5), (1, 0.75), (1, 0.9), (1, 1.1), (2, 1.0)]  # (Euler steps, step scale alpha)


def scale_velocity(drafter: ChainFlowDrafter, alpha: float):
    """Make each Euler step of `drafter` `z <- z + alpha * v(z, s, c) / N` (a forward hook on its velocity
    network, on this instance only); returns the hook's handle: `.remove()` undoes it."""
    return drafter.velocity.register_forward_hook(lambda module, inputs, v: alpha * v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="prepared held-out data (hf-chainflow prepare)")
    parser.add_argument("--drafter", default=str(default_drafter_path()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_model_and_tokenizer("smollm2-135m-instruct", torch.float32)
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target, dtype=torch.float32)
    data = _window_dataset(args.data, drafter.config, shards=None)
    # relative state error of the decoded final state on 1,500 seeded windows
    idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:1500].tolist()
    batch = [data[i] for i in idx]

    def stack(key):
        return torch.stack([torch.as_tensor(w[key]) for w in batch])

    results = {}
    for steps, alpha in SETTINGS:
        hook = scale_velocity(drafter, alpha)
        with torch.no_grad():
            ctx, cmask = stack("context_states").float(), stack("context_mask")
            tgt, tmask = stack("target_states").float(), stack("target_mask").bool()
            pred = drafter.predict_states(ctx, cmask, num_flow_steps=steps, velocity=serving_velocity(drafter)).float()
            err = (pred - tgt).pow(2).sum(-1) / tgt.pow(2).sum(-1).clamp(min=1e-6)  # (B, K)
            per_k = [err[:, k][tmask[:, k]].mean().item() for k in range(err.shape[1])]
        r = evaluate_offline(drafter, data, num_tokens=3, max_windows=3000, tree=(8, 4), tree_budget=12,
                             max_tree_windows=400, num_flow_steps=steps, walk_sequences=64, progress=False)
        results[f"N={steps} alpha={alpha}"] = dict(
            rel_err_per_k=per_k, tau=r["tau"], acc=r["acceptance"], tree=r["tree"]["tau"],
            walk_chain=r["walk"]["chain"]["tau"], walk_tree=r["walk"]["tree"]["tau"])
        print(f"N={steps} alpha={alpha}: relerr k1..4 {[round(x, 3) for x in per_k[:4]]} chain tau "
              f"{r['tau']:.3f} acc {[round(a, 3) for a in r['acceptance']]} tree {r['tree']['tau']:.3f} "
              f"walk chain {r['walk']['chain']['tau']:.3f} tree {r['walk']['tree']['tau']:.3f}", flush=True)
        hook.remove()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
