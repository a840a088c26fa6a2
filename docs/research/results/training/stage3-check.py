"""Device-side check: the re-prepared data equals the CPU-prepared data (plan, tokens) and its hidden states agree."""
import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file
ref = load_file(".dev/check.safetensors")
with safe_open("/tmp/data/shards/shard-00000.safetensors", "pt") as f:
    h = f.get_slice("hidden")[:2000].float(); t = f.get_tensor("tokens")[:2000]
m = json.load(open("/tmp/data/manifest.json"))
diff = (h - ref["hidden"].float()).abs()
print(f"check: plan_sha256 match {m['plan_sha256'] == 'c76f020344925b2ecaa5c8c93fe853f42d07c737e348106e5d2f252d874f996f'}, "
      f"tokens equal {torch.equal(t, ref['tokens'])}, hidden max|diff| {diff.max():.4g}, mean|diff| {diff.mean():.3g}, "
      f"mean|h| {ref['hidden'].float().abs().mean():.3g}, shards {len(m['finished'])}")
ok = m["plan_sha256"].startswith("c76f0203") and torch.equal(t, ref["tokens"]) and diff.max() < 0.05 * ref["hidden"].float().abs().max()
sys.exit(0 if ok else 1)
