"""Which discrete op amplified the [1, rest] chunking difference of 521fd56's model (issue 15).

    git archive 521fd56 sglang_dsv4 | tar -x -C .bench-old && mv .bench-old/sglang_dsv4 .bench-old/sglang_dsv4_old
    python scripts/chunk_flip_probe.py [micro|tiny] [seeds]

Per seed: a 300-token random prompt and its 200-token greedy continuation (decoded by the old
model), prefilled uncut and cut as [1, rest] (the cut a server makes after a cached BOS token).
Every call of the old model's discrete ops is recorded in both runs and compared position by
position: the QAT roundings (fp8_qat of the window KV and entries, fp4_qat of the indexer queries
and keys: an element "jumps" when its output moves by over 1000x its input's move), the indexer's
select_topk and the router's top-k (rows that choose differently). Today's tree is chunk-invariant
on the CPU (tests/core/test_chunk_invariance.py), so there is nothing to amplify.
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".bench-old"))
sys.path.insert(1, str(ROOT))
import sglang_dsv4_old.core.ops as ops
import sglang_dsv4_old.core.model as model_mod
from sglang_dsv4_old.checkpoint import load_checkpoint
from sglang_dsv4_old.core.cache import V4Cache
from sglang_dsv4.tiny import ensure_tiny
from sglang_dsv4.launch_server import cache_dir

REC = []
def recorder(name, fn):
    def wrapped(*a, **k):
        out = fn(*a, **k)
        x = a[0]
        REC.append((name, x.detach().clone(), (out if isinstance(out, torch.Tensor) else out.indices).detach().clone()))
        return out
    return wrapped
ops.fp8_qat = recorder("fp8_qat", ops.fp8_qat)
ops.fp4_qat = recorder("fp4_qat", ops.fp4_qat)
ops.select_topk = recorder("select_topk", ops.select_topk)
_topk = torch.topk
def topk_rec(x, k, dim=-1, **kw):
    out = _topk(x, k, dim=dim, **kw)
    REC.append(("route_topk", x.detach().clone(), out.indices.detach().clone()))
    return out
ops.torch = type("T", (), {"__getattr__": lambda self, n: topk_rec if n == "topk" else getattr(torch, n)})()

ckpt = load_checkpoint(ensure_tiny(sys.argv[1] if len(sys.argv) > 1 else "micro", 0, cache_dir()))
cfg = ckpt.config
model = model_mod.V4Model(cfg, ckpt.tensors)

def run(ids, cuts):
    cache = V4Cache(cfg, max_requests=1, max_total_tokens=4096, backend="torch")
    req = cache.new_request()
    calls, logits = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        REC.clear()
        logits.append(model.forward(cache, [req], [ids[a:b]])[0])
        calls.append(list(REC))
    return calls, torch.cat(logits)

for seed in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=g)
    # the prompt's greedy continuation (200 tokens, decoded uncut), as a server's long output
    cache = V4Cache(cfg, max_requests=1, max_total_tokens=4096, backend="torch")
    req = cache.new_request()
    out = [int(model.forward(cache, [req], [prompt])[0][-1].argmax())]
    for _ in range(199):
        out.append(int(model.forward(cache, [req], [torch.tensor(out[-1:])])[0][-1].argmax()))
    ids = torch.cat((prompt, torch.tensor(out)))
    n = ids.numel()
    (U,), lu = run(ids, [0, n])
    (C1, C2), lc = run(ids, [0, 1, n])
    d = (lu - lc).abs().max(-1).values
    first = int((d > 1e-3).nonzero()[0]) if (d > 1e-3).any() else None
    print(f"seed {seed}: max logit diff {d.max():.3g}, first position > 1e-3: {first}, argmax flips "
          f"{int((lu.argmax(-1) != lc.argmax(-1)).sum())}")
    j1 = 0
    events = []
    for k, (name, xu, yu) in enumerate(U):
        name2, x2, y2 = C2[k]
        assert name2 == name
        if (xu.shape[0] == x2.shape[0] + 1 and k < len(C1) and C1[k][0] == name
                and C1[k][1].shape[1:] == x2.shape[1:] and C1[k][2].shape[1:] == y2.shape[1:]):
            xc, yc = torch.cat((C1[k][1], x2)), torch.cat((C1[k][2], y2))
        elif xu.shape == x2.shape:
            xc, yc = x2, y2
        else:
            continue
        if xc.shape != xu.shape:
            continue
        if name in ("select_topk", "route_topk"):
            diff_rows = (torch.sort(yu, -1).values != torch.sort(yc, -1).values).any(-1)
            if diff_rows.any():
                events.append((k, name, tuple(xu.shape), f"{int(diff_rows.sum())} rows choose differently, first row {int(diff_rows.nonzero()[0])}, input diff {float((xu - xc).abs().max()):.2e}"))
            continue
        dx = (xu - xc).abs().max()
        dy = (yu.float() - yc.float()).abs()
        jumps = dy > 1e3 * max(float(dx), 1e-30)
        if dx > 0 or dy.max() > 0:
            events.append((k, name, tuple(xu.shape), f"input diff {float(dx):.2e}, output diff {float(dy.max()):.2e}, {int(jumps.sum())} elements jump a rounding step"))
    for e in events[:12]:
        print("   call", *e)
