import sys, json, time, tempfile, torch
torch.set_num_threads(1)
from transformers import AutoModel
from hf_chainflow.targets import load_model_and_tokenizer
from hf_chainflow.training.corpus import ResponseCorpus
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.dflash import dflash_block_logits
from hf_chainflow.training.dflash_data import DFlashWindowDataset
from hf_chainflow.training.dflash_trainer import evaluate_dflash_offline
from hf_chainflow.training.losses import block_acceptance_lengths

N = int(sys.argv[1])
target, tok = load_model_and_tokenizer('smollm2-135m-instruct')
drafter = AutoModel.from_pretrained('/work/runs/levers/DF1', dtype=torch.float32).eval()
c = drafter.config; C, B = c.sliding_window, c.block_size
corpus = ResponseCorpus('/work/wt-dflash/corpus/smollm2-135m-instruct')
train_ids = json.load(open('/work/dflash-gap-exp/train_ids.json'))
tr = corpus.responses('train'); ho = corpus.responses('heldout')
sets = {"trained": {k: tr[k] for k in train_ids[:N]}, "heldout": {k: ho[k] for k in sorted(ho)[:N]}}
unseen = [k for k in list(tr)[::997] if k not in set(train_ids)][:N]
sets["train_unseen"] = {k: tr[k] for k in unseen}
for name, rows in sets.items():
    t0 = time.time()
    rows = {k: {"id": k, "prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"], "domain": r["domain"]} for k, r in rows.items()}
    with tempfile.TemporaryDirectory() as d:
        prepare(target, tok, f"{d}/data", responses=rows, target_layers=c.target_layer_ids, shard_size=64,
                generation_dtype=torch.bfloat16, progress=False)
        w = DFlashWindowDataset.for_drafter(f"{d}/data", c)
        r = evaluate_dflash_offline(drafter, target, w, batch_size=64)
        # early anchors: truncated (training) context vs full 32-row context from a full forward (serving)
        early_tr, early_full = [], []
        for k in range(len(w)):
            it = w[k]
            seq = w.sequences[int(w.seq_of[k])]
            p = int(it["position_ids"][C]); P = seq["prompt_len"]
            if p - P >= C - 16 or p < P: continue
            row = rows[seq["id"]]
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            with torch.no_grad():
                hs = target(ids[:, :p], output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1][0] for i in c.target_layer_ids], -1)
            n = min(C, p)
            full = dict(it); full["context_states"] = torch.zeros_like(it["context_states"])
            full["context_states"][C - n:] = feats[p - n:p]; full["context_mask"] = torch.zeros(C, dtype=torch.bool)
            full["context_mask"][C - n:] = True
            for store, item in ((early_tr, it), (early_full, full)):
                with torch.no_grad():
                    pred = dflash_block_logits(drafter, target, {k2: v[None] for k2, v in item.items()}).argmax(-1)
                store.append(int(block_acceptance_lengths(pred, it["labels"][None], it["label_mask"][None])))
    print(json.dumps({"set": name, "rows": len(rows), "offline_tau": round(r["tau"], 3), "acc": round(r["accuracy"], 3),
                      "windows": r["windows"], "early_tau_trainctx": 1 + sum(early_tr) / max(1, len(early_tr)),
                      "early_tau_fullctx": 1 + sum(early_full) / max(1, len(early_full)), "n_early": len(early_tr),
                      "secs": round(time.time() - t0)}), flush=True)
