"""Drafter block and target row costs against one decode step (2 threads): python block_timing.py [DRAFTER]"""
from pathlib import Path
import pydflash
TEXT = (Path(pydflash.__file__).parent / "train" / "prompts.py").read_text()  # a real Python file as the context
import time, statistics as st, sys
import numpy as np
from pydflash.runtime.target import Target
from pydflash.runtime.drafter import Drafter
from pydflash.fetch import registry

t = Target("smollm2-135m", n_ctx=2048, n_threads=2)
d = Drafter(str(Path(pydflash.__file__).parent / "drafters/smollm2-135m-instruct-dflash2.gguf") if len(sys.argv) < 2 else sys.argv[1], t, n_threads=2)
t.set_taps(d.target_layers)
prompt = t.tokenize(TEXT[:3000])[:240]
t.decode(prompt)
taps = [t.tap_rows(i) for i in range(len(d.target_layers))]
d.inject_taps(taps, list(range(len(prompt))))
pos = len(prompt)
tok = prompt[-1]
def timeit(f, n=40):
    xs = []
    for _ in range(n):
        a = time.perf_counter(); f(); xs.append((time.perf_counter() - a) * 1e3)
    return st.median(xs)
res = {}
def step():
    global pos
    t.decode([tok]); t.rollback(pos); 
def rows(k):
    def f():
        t.decode([tok] * k, pos=list(range(pos, pos + k)), all_logits=True); t.rollback(pos)
    return f
for rnd in range(3):
    res.setdefault("target 1", []).append(timeit(step))
    for k in (2, 4, 8):
        res.setdefault(f"target {k}", []).append(timeit(rows(k)))
    for nb in (2, 4, 8):
        res.setdefault(f"block fwd {nb}", []).append(timeit(lambda: d.forward(tok, pos, nb)))
        res.setdefault(f"block propose {nb}", []).append(timeit(lambda: d.propose(tok, pos, nb)))
    def inj():
        d.inject_taps([x[:1] for x in taps], [pos]); d.crop(pos)
    res.setdefault("inject 1", []).append(timeit(inj))
base = st.median(res["target 1"])
for k, v in res.items():
    m = st.median(v); print(f"{k:20s} {m:7.3f} ms  {m/base:5.2f} steps")
