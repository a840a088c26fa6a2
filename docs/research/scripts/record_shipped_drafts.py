"""Re-record tests/fixtures/shipped_drafts.json when the shipped drafter's weights change.

The slow test `test_the_shipped_drafter_drafts_what_it_drafted_before_the_new_fields` pins the shipped drafter's
chains and trees at two fixed contexts of one greedy answer. When new weights ship, this script first checks that the
previous weights (`--previous`, a copy of the folder that was shipped) still draft exactly what the fixture holds
(so the code has not drifted), then records the drafts of the weights now in `hf_chainflow/checkpoints/` with the
same calls and writes the fixture. Run it on the machine kind the fixture was written on (AVX-512 BF16):

    python docs/research/scripts/record_shipped_drafts.py --previous runs/levers/C13
"""

import argparse
import json

import torch

import hf_chainflow  # noqa: F401
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting, serving
from hf_chainflow.targets import load_target
from hf_chainflow.generation.verification import select_target_states

FIXTURE = "tests/fixtures/shipped_drafts.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--previous", required=True, help="the previously shipped drafter folder")
    parser.add_argument("--fixture", default=FIXTURE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ref = json.load(open(args.fixture))
    target, _ = load_target()
    ids = torch.tensor([ref["ids"]])
    with torch.no_grad():
        states = select_target_states(target(ids, output_hidden_states=True).hidden_states, ())

    def drafts(path):
        drafter = ChainFlowDrafter.from_pretrained(path, target=target).eval()
        out = []
        for case in ref["cases"]:
            cut = case["cut"]
            tree = drafting.draft(drafter, states[:, :cut - 1], ids[:, :cut], **case["kwargs"])
            row = {"cut": cut, "kwargs": case["kwargs"], "tokens": tree.tokens.tolist(),
                   "parents": tree.parents.tolist()}
            if "states_sum" in case:
                row["states_sum"] = float(drafter.predict_states(
                    states[:, :cut - 1], velocity=serving.serving_velocity(drafter)).double().sum())
            out.append(row)
        return out

    for got, want in zip(drafts(args.previous), ref["cases"]):
        if (got["tokens"], got["parents"]) != (want["tokens"], want["parents"]) or (
                "states_sum" in want and abs(got["states_sum"] - want["states_sum"]) > 1e-9 * abs(want["states_sum"])):
            raise SystemExit(f"--previous {args.previous} no longer drafts what {args.fixture} holds at {want['kwargs']}, "
                             f"cut {want['cut']}: the code changed the drafts; fix that before re-recording")
    print(f"{args.previous} reproduces {args.fixture}")
    ref["cases"] = drafts(default_drafter_path())
    with open(args.fixture, "w") as f:
        json.dump(ref, f, indent=1)
    print(f"wrote {args.fixture} for {default_drafter_path()}")


if __name__ == "__main__":
    main()
