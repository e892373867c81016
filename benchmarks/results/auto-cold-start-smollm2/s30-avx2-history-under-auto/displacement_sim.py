"""Does drafting where the history has no match displace the history's own accepted drafts?
Fixed greedy text (SmolLM2, HumanEval 132-163, 128 tokens); history = lookup_simulation.propose."""
import json, os, random, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from lookup_simulation import simulate

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
    """A stand-in drafter beside the history: right with probability p_draft per draft, up to width."""
    rng = random.Random(seed)

    def drafter(cont, i):
        a = 0
        while a < width and i + a < len(cont) and rng.random() < p_draft:
            a += 1
        return a

    r = simulate(data, n_max, min_n, drafter if p_draft > 0 else None)
    return dict(p=p_draft, width=width, steps=r["steps"], hist_acc=r["accepted_from_history"],
                drafter_acc=r["accepted_from_fallback"], hist_steps_acc_ge5=r["history_steps_accepting_5_or_more"])


for pd, w in ((0, 0), (0.737, 1), (0.6, 2), (0.737, 3)):
    print(json.dumps(run(pd, w)))
