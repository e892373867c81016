#!/bin/bash
# the README's main command with its defaults vs --no-draft vs n_max 3, fresh processes, interleaved
P='def quicksort(arr):
    """Sort the list arr with quicksort and return the sorted list."""
'
for r in 1 2 3; do
  for mode in default nodraft n3; do
    case $mode in default) extra=();; nodraft) extra=(--no-draft);; n3) extra=(--spec-draft-n-max 3);; esac
    echo "== $mode round $r"
    pydflash generate -m smollm2-135m -p "$P" -n 128 --temp 0 -t 2 "${extra[@]}" 2>&1 >/dev/null | tail -3
  done
done
