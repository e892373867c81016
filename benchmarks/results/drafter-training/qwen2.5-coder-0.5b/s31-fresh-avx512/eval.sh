#!/usr/bin/env bash
# q3 against the shipped q2: profile, other-code tau, the main command with both drafters in one run
set -x
cd /work/main
R=/work/runs/s31
cp $R/q3/Qwen2.5-Coder-0.5B-Instruct-DFlash2-Q4_K_M.gguf $R/Q3.gguf
/usr/bin/time -f "%e s" pydflash drafter-profile $R/Q3.gguf --target qwen2.5-coder-0.5b -t 2 > $R/profile-q3.log 2>&1
python benchmarks/drafter_tau.py --target qwen2.5-coder-0.5b --drafter q2=pydflash/drafters/qwen2.5-coder-0.5b-instruct-dflash2.gguf --drafter q3=$R/Q3.gguf --n-max 7 --lookup 0 --prompts benchmarks/results/drafter-training/smollm2-135m/s29-in-domain/other-code-prompts.jsonl --max-tokens 128 --threads 2 --no-t1 --no-plain --json $R/tau-other-code-q2-q3.json > $R/tau-other.log 2>&1
python benchmarks/auto_cold_start.py -m qwen2.5-coder-0.5b --candidate $R/Q3.gguf --limit 32 -n 128 -t 2 --repeats 1 --modes plain,auto-cold,auto-cold-cand --out $R/main-q2-q3 > $R/main-q2-q3.log 2>&1
