import hashlib, json, random
from hf_chainflow.training.corpus import ResponseCorpus
c = ResponseCorpus('/work/wt-dflash/corpus/smollm2-135m-instruct')
resp = c.responses('train')
ids = list(resp)
print(len(ids))
random.Random(0).shuffle(ids)
print(hashlib.sha256("\n".join(ids).encode()).hexdigest())
json.dump(ids[:896], open('/work/dflash-gap-exp/train_ids.json', 'w'))
