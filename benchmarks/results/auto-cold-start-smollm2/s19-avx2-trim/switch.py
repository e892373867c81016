"""Target steps of alternating row counts (the cost of a shape switch): python switch.py"""
from pathlib import Path
import pydflash
TEXT = (Path(pydflash.__file__).parent / "train" / "prompts.py").read_text()  # a real Python file as the context
import time, statistics as st
from pydflash.runtime.target import Target
t = Target("smollm2-135m", n_ctx=2048, n_threads=2)
prompt = t.tokenize(TEXT[:3000])[:240]
t.decode(prompt); pos = len(prompt); tok = prompt[-1]
def dec(k):
    global pos
    a = time.perf_counter()
    t.decode([tok] * k, pos=list(range(pos, pos + k)), all_logits=k > 1)
    ms = (time.perf_counter() - a) * 1e3
    pos += 1; t.rollback(pos)   # keep one row, as a step that accepted nothing
    return ms
for pattern in ([1], [2], [1, 2], [1, 1, 2], [1, 3], [1,4,1,2]):
    xs = {}
    for _ in range(30):
        for k in pattern:
            xs.setdefault(k, []).append(dec(k))
    print(pattern, {k: round(st.median(v), 2) for k, v in xs.items()})
