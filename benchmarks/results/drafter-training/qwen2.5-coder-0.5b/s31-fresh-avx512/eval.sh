#!/usr/bin/env bash
# session 31: a candidate (q3.sh's export) against the shipped Qwen2.5-Coder-0.5B drafter: its acceptance profile
# (written into the file), tau on code from eight unused packages, and the main command with both drafters in one
# run. Run as RUN=... (q3.sh's) OUT=DIR; then, if it wins, copy OUT/Q3.gguf over the shipped file.
set -euxo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../../../../.." && pwd)
RUN=${RUN:?}; OUT=${OUT:?}; mkdir -p "$OUT"; cd "$ROOT"
cp "$RUN/Qwen2.5-Coder-0.5B-Instruct-DFlash2-Q4_K_M.gguf" "$OUT/Q3.gguf"
pydflash drafter-profile "$OUT/Q3.gguf" --target qwen2.5-coder-0.5b -t 2 > "$OUT/profile-q3.log" 2>&1
python benchmarks/drafter_tau.py --target qwen2.5-coder-0.5b --drafter q2=pydflash/drafters/qwen2.5-coder-0.5b-instruct-dflash2.gguf \
  --drafter q3="$OUT/Q3.gguf" --n-max 7 --lookup 0 --prompts benchmarks/results/drafter-training/smollm2-135m/s29-in-domain/other-code-prompts.jsonl \
  --max-tokens 128 --threads 2 --no-t1 --no-plain --json "$OUT/tau-other-code-q2-q3.json" > "$OUT/tau-other.log" 2>&1
python benchmarks/auto_cold_start.py -m qwen2.5-coder-0.5b --candidate "$OUT/Q3.gguf" --limit 32 -n 128 -t 2 --repeats 1 \
  --modes plain,auto-cold,auto-cold-cand --out "$OUT/main-q2-q3" > "$OUT/main-q2-q3.log" 2>&1
python benchmarks/auto_cold_start_ci.py "$OUT/main-q2-q3/results.json" --pair auto-cold-cand,auto-cold
