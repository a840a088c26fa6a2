import sys, json, time, tempfile, torch
torch.set_num_threads(1)
from transformers import AutoModel
from hf_chainflow.targets import load_model_and_tokenizer
from hf_chainflow.training.corpus import ResponseCorpus
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.dflash import dflash_block_logits
from hf_chainflow.training.dflash_data import DFlashWindowDataset
from types import SimpleNamespace

NPROMPT = int(sys.argv[1]) if len(sys.argv) > 1 else 1
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 64
target, tok = load_model_and_tokenizer('smollm2-135m-instruct')
drafter = AutoModel.from_pretrained('/work/runs/levers/DF1', dtype=torch.float32).eval()
c = drafter.config
C, B = c.sliding_window, c.block_size
SPLIT = sys.argv[3] if len(sys.argv) > 3 else 'heldout'
rows = ResponseCorpus('/work/wt-dflash/corpus/smollm2-135m-instruct').responses(SPLIT)
keys = sys.argv[4].split(',') if len(sys.argv) > 4 else sorted(rows)[:NPROMPT]
calls = []
def hook(module, args, kwargs, out):
    calls.append({"positions": kwargs["position_ids"].clone(), "context": kwargs["context_hidden_states"].shape[1],
                  "ctx_states": kwargs["context_hidden_states"].clone(),
                  "hidden": out.last_hidden_state.clone()})
res = []
for key in keys:
    row = rows[key]
    h = drafter.register_forward_hook(hook, with_kwargs=True)
    prompt = torch.tensor([row["prompt_ids"]])
    calls.clear()
    t0 = time.time()
    with torch.no_grad():
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                              assistant_model=drafter, speculation_type="dflash", eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
    h.remove()
    gen = out[0, prompt.shape[1]:].tolist()
    same = gen == row["response_ids"][:len(gen)]
    # training windows exactly as the training code builds them: prepare the (prompt, generated response) row
    with tempfile.TemporaryDirectory() as d:
        prepare(target, tok, f"{d}/data", responses={key: {"id": key, "prompt_ids": row["prompt_ids"],
                "response_ids": gen, "domain": row.get("domain", "x")}}, target_layers=c.target_layer_ids,
                shard_size=8, generation_dtype=torch.float32, progress=False)
        w = DFlashWindowDataset.for_drafter(f"{d}/data", c)
        items = [w[k] for k in range(len(w))]
    by_pos = {int(it["position_ids"][C]): it for it in items}  # bonus position -> window
    P = prompt.shape[1]
    rounds = []
    for ci, call in enumerate(calls):
        p = int(call["positions"][0, -B])
        stock_pred = target.get_output_embeddings()(call["hidden"][:, 1:]).argmax(-1)[0]
        # accepted in serving: leading matches of stock predictions against the true continuation
        truth = out[0, p + 1:p + B]
        acc = int(((stock_pred[:len(truth)] == truth).long().cumprod(0)).sum())
        it = by_pos.get(p)
        if it is None:
            rounds.append({"p": p, "acc_stock": acc, "window": None}); continue
        batch = {k: v[None] for k, v in it.items()}
        with torch.no_grad():
            logits = dflash_block_logits(drafter, target, batch)
            stock_logits = target.get_output_embeddings()(call["hidden"][:, 1:])
        tp = logits.argmax(-1)[0]
        n_lab = int(it["label_mask"].sum())
        acc_train = int(((tp[:n_lab] == it["labels"][:n_lab]).long().cumprod(0)).sum())
        rounds.append({"p": p, "ctx_new": call["context"], "acc_stock": acc, "acc_train": acc_train,
                       "argmax_agree": int((tp == stock_pred).sum()), "maxdiff": (logits - stock_logits).abs().max().item(),
                       "bonus_ok": int(it["bonus_token"]) == int(out[0, p])})
    # offline tau over all anchors in the response
    acc_all = []
    for it in items:
        if int(it["position_ids"][C]) < P: continue
        batch = {k: v[None] for k, v in it.items()}
        with torch.no_grad():
            tp = dflash_block_logits(drafter, target, batch).argmax(-1)[0]
        n_lab = int(it["label_mask"].sum())
        if n_lab == 0: continue
        acc_all.append(int(((tp[:n_lab] == it["labels"][:n_lab]).long().cumprod(0)).sum()))
    early = [x for x in rounds if x["p"] < P + 16]; late = [x for x in rounds if x["p"] >= P + 16]
    summ = lambda xs, k: round(sum(x[k] for x in xs) / max(1, len(xs)), 3)
    r = {"key": key, "P": P, "gen_equals_corpus": same, "n_rounds": len(rounds),
         "early": {"n": len(early), "acc_stock": summ(early, "acc_stock"), "acc_train": summ(early, "acc_train"), "agree": summ(early, "argmax_agree")},
         "late": {"n": len(late), "acc_stock": summ(late, "acc_stock"), "acc_train": summ(late, "acc_train"), "agree": summ(late, "argmax_agree"), "maxdiff": max([x["maxdiff"] for x in late] or [0])}, "offline_tau_all_anchors": 1 + sum(acc_all) / len(acc_all),
         "served_tau": len(gen) / max(1, len(calls)), "secs": time.time() - t0}
    res.append(r)
    print(json.dumps(r), flush=True)
