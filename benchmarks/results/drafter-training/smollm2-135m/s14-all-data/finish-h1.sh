#!/usr/bin/env bash
cd /work/runs/s14
python /work/main/benchmarks/drafter_train_vs_engine.py --portable /work/runs/s14/h1/portable.pt --layers 2 --cache /work/runs/s13/heldout-cache --out /work/runs/s14/walk-h1.json > /dev/null 2>&1
python /work/main/benchmarks/drafter_copy_diagnosis.py /work/runs/s14/h1/portable.pt --layers 2 --cache /work/runs/s13/heldout-cache --out /work/runs/s14/diag-h1.json > /dev/null 2>&1
python - <<'P'
import json
w=json.load(open('/work/runs/s14/walk-h1.json')); d=json.load(open('/work/runs/s14/diag-h1.json'))
c=json.loads(open('/work/runs/s14/h1/curve.jsonl').read().strip().splitlines()[-1])
print("engine", round(c['tau'],4), c['tokens'], c['verify_steps'], [round(x/c['verify_steps'],3) for x in c['accepted_per_position'][:4]])
print("walk", w['walk_tau'], w['walk_accepted_per_position'][:4])
print({k:v for k,v in d.items() if k not in ('checkpoint','cache')})
P
