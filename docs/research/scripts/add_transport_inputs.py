"""A copy of a trained drafter with the optional transport inputs added, drafting exactly what it drafted.

`bonus_embedding` and `target_layer_ids` (docs/architecture.md, "Optional transport inputs") are zero-initialised,
so a drafter that gains them computes what it computed until training moves their weights; `--init-from` keeps a
drafter's config, so this script writes the grown copy that a warm-started arm starts from. The fused layers'
statistics come from `--data` (prepared with `--target-layers` naming them), as `hf-chainflow train` takes them for a
fresh drafter. Before saving, it checks on `--windows` windows of `--data` that the copy's chains and trees equal the
original's (the serving search on batches of windows, `hf_chainflow.training.evaluation.draft_batch`).

    python docs/research/scripts/add_transport_inputs.py --drafter hf_chainflow/checkpoints/smollm2-135m-instruct \\
        --bonus-embedding --target-layer-ids 1,14,26 --data runs/levers/train --out runs/levers/init-BL
"""

import argparse
import copy

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.training.windows import ChainFlowWindowDataset, collate
from hf_chainflow.training.prepared_data import layer_statistics
from hf_chainflow.training.evaluation import draft_batch
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.targets import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="the trained drafter (a save_pretrained folder)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="known target name or model folder")
    parser.add_argument("--bonus-embedding", action="store_true", help="add the bonus token's embedding")
    parser.add_argument("--target-layer-ids", help="comma-separated decoder layers to fuse, e.g. 1,14,26")
    parser.add_argument("--data", required=True, help="prepared data (with the layers, for their statistics)")
    parser.add_argument("--shards", help="comma-separated shards of --data for the statistics (default: all)")
    parser.add_argument("--windows", type=int, default=256, help="windows of --data the drafts are compared on")
    parser.add_argument("--out", required=True, help="folder of the grown copy")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [int(i) for i in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    if not args.bonus_embedding and layers is None:
        raise SystemExit("nothing to add: give --bonus-embedding and/or --target-layer-ids")
    shards = [int(s) for s in args.shards.split(",")] if args.shards else None
    target, _ = load_model_and_tokenizer(args.target)
    old = ChainFlowDrafter.from_pretrained(args.drafter, target=target).eval()
    config = copy.deepcopy(old.config)
    config.bonus_embedding = args.bonus_embedding or config.bonus_embedding
    config.target_layer_ids = layers if layers is not None else config.target_layer_ids
    config.check_fields()
    new = ChainFlowDrafter(config).bind_target(target)
    missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
    added = [k for k in missing if "bonus_proj" in k or "layer_fusion" in k]
    if unexpected or len(added) != len(missing):
        raise SystemExit(f"the copy does not take the drafter's weights: missing {missing}, unexpected {unexpected}")
    if new.layer_fusion is not None:
        new.set_layer_statistics(*layer_statistics(args.data, new.config.target_layer_ids, shards=shards))
    new.generation_config = old.generation_config
    new.eval()

    windows = ChainFlowWindowDataset.for_drafter(args.data, new.config, max_windows=args.windows, shards=shards)
    D, p = old.config.target_hidden_size, old.config.path_order
    searches = [SearchSettings(mode="chain", num_tokens=3, max_depth=new.max_draft_depth),
                SearchSettings(mode="tree", tree_width=8, tree_depth=4, tree_budget=12, max_depth=new.max_draft_depth)]
    compared = 0
    for start in range(0, len(windows), 64):
        batch = collate([windows[i] for i in range(start, min(start + 64, len(windows)))])
        committed = batch["prev_tokens"][:, :p]
        for settings in searches:
            a = draft_batch(old, batch["context_states"][..., :D], batch["context_mask"], committed, settings)
            b = draft_batch(new, batch["context_states"], batch["context_mask"], committed, settings)
            if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)):
                raise SystemExit(f"the copy drafts differently on windows {start}..{start + 63} ({settings.mode})")
        compared += batch["context_states"].shape[0]
    new.save_pretrained(args.out)
    print(f"saved {args.out}: bonus_embedding={new.config.bonus_embedding}, target_layer_ids="
          f"{new.config.target_layer_ids}; chains and trees equal to {args.drafter}'s on {compared} windows")


if __name__ == "__main__":
    main()
