"""Decode logits of the by-kv-head attention (CELLM_GPU_ATTN_GQA=1) against the per-query-head
build (=0) on the same GPU: 8 one-token steps after 2048 cached tokens, then a step of 4
tokens of that session and 4 of another after 130; and, as the yardstick, the per-query-head
build in other splits (CELLM_GPU_ATTN_WGS=333: the same math in another order). Random-weight
models amplify any reordering, so the two differences should be of one size. One JSON line
per model.

usage: python benches/gpu_attn_check.py MODELS   (comma-separated GGUF or .cellm paths)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main() -> int:
    from cellm import LLM

    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 20000, 2200)]
    for path in sys.argv[1].split(","):
        outs = []
        # By query head; by kv head; by query head in other splits (a reordering alone).
        for v, wgs in (("0", "1024"), ("1", "1024"), ("0", "333")):
            os.environ["CELLM_GPU_ATTN_GQA"] = v
            os.environ["CELLM_GPU_ATTN_WGS"] = wgs
            e = LLM(path, backend="vulkan", context_length=4096)._engine
            a, b = e.create_session(), e.create_session()
            e.step([(a, ids[:2048])])
            e.step([(b, ids[:130])])
            rows = []
            for t in ids[2048:2056]:
                rows.append(np.asarray(e.step([(a, [t])]))[-1])
            r = np.asarray(e.step([(a, ids[2056:2060]), (b, ids[130:134])], all_logits=True))
            rows.extend(list(r))
            outs.append(np.stack(rows))
            del e
        row = {"model": os.path.basename(path)}
        for name, o in (("gqa", outs[1]), ("reordered", outs[2])):
            d = float(np.abs(outs[0] - o).max()) / float(np.abs(outs[0]).max())
            agree = int((outs[0].argmax(-1) == o.argmax(-1)).sum())
            row[name] = {"rel_diff": d, "argmax_agree": f"{agree}/{len(o)}"}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
