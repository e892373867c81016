"""Does drafting where the history has no match displace the history's own accepted drafts?
Fixed greedy text (SmolLM2, HumanEval 132-163, 128 tokens); history = lookup_simulation.propose."""
import json, os, random, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from lookup_simulation import propose

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "greedy.json")
if not os.path.exists(DATA):
    from pydflash.runtime.target import Target
    from pydflash.train.prompts import held_out_humaneval
    data = []
    with Target("smollm2-135m", n_ctx=1024, n_threads=1) as t:
        for p in held_out_humaneval():
            toks = t.tokenize(p.text)
            data.append((toks, list(t.generate(toks, max_tokens=128, temperature=0).tokens)))
    json.dump(data, open(DATA, "w"))
data = json.load(open(DATA))

def run(p_draft, width, n_max=15, min_n=2, seed=0):
    rng = random.Random(seed)
    steps = hist_acc = dr_acc = long_steps = 0
    for prompt, cont in data:
        i = 0
        while i < len(cont):
            d = propose(prompt + cont[:i], n_max, min_n)
            a = 0
            if d:
                while a < len(d) and i + a < len(cont) and d[a] == cont[i + a]:
                    a += 1
                hist_acc += a; long_steps += a >= 5
            elif p_draft > 0:
                while a < width and i + a < len(cont) and rng.random() < p_draft:
                    a += 1
                dr_acc += a
            i += a + 1; steps += 1
    return dict(p=p_draft, width=width, steps=steps, hist_acc=hist_acc, drafter_acc=dr_acc, hist_steps_acc_ge5=long_steps)

for pd, w in ((0, 0), (0.737, 1), (0.6, 2), (0.737, 3)):
    print(json.dumps(run(pd, w)))
