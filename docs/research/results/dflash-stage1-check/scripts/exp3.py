import json, time, torch
torch.set_num_threads(1)
from transformers import AutoModel
from hf_chainflow.targets import load_model_and_tokenizer
from hf_chainflow.training.corpus import ResponseCorpus
target, tok = load_model_and_tokenizer('smollm2-135m-instruct')
drafter = AutoModel.from_pretrained('/work/runs/levers/DF1', dtype=torch.float32).eval()
corpus = ResponseCorpus('/work/wt-dflash/corpus/smollm2-135m-instruct')
tr = corpus.responses('train'); ho = corpus.responses('heldout')
train_ids = json.load(open('/work/dflash-gap-exp/train_ids.json'))
n = [0]
drafter.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
for name, rows in (("trained", [tr[k] for k in train_ids[4:8]]), ("heldout", [ho[k] for k in sorted(ho)[4:8]])):
    for r in rows:
        ids = torch.tensor([r["prompt_ids"]]); n[0] = 0
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            out = target.generate(ids, assistant_model=drafter, speculation_type="dflash", **kw)
        gen = out[0, ids.shape[1]:].tolist(); ref = r["response_ids"][:len(gen)]
        agree = next((i for i, (a, b) in enumerate(zip(gen, ref)) if a != b), min(len(gen), len(ref)))
        print(json.dumps({"set": name, "id": r["id"], "new": len(gen), "rounds": n[0], "tau": round(len(gen) / n[0], 2),
                          "same_as_corpus_first": agree}), flush=True)
