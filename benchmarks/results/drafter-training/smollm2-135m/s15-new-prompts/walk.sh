#!/usr/bin/env bash
# walk + copy diagnosis of a portable checkpoint on the held-out text: walk.sh NAME CK (LAYERS=N for another depth, since session 27)
cd ${RUN:-/work/runs/s15}
python /work/main/benchmarks/drafter_train_vs_engine.py --portable $2 --layers ${LAYERS:-2} --cache /work/runs/s15/heldout-cache --out walk-$1.json > walk-$1.log 2>&1
python /work/main/benchmarks/drafter_copy_diagnosis.py $2 --layers ${LAYERS:-2} --cache /work/runs/s15/heldout-cache --out diag-$1.json > diag-$1.log 2>&1
python - $1 <<'P'
import json,sys
n=sys.argv[1]; w=json.load(open(f'walk-{n}.json')); d=json.load(open(f'diag-{n}.json'))
print(n, "walk", w['walk_tau'], w['walk_accepted_per_position'][:4])
print({k:v for k,v in d.items() if k not in ('checkpoint','cache')})
P
