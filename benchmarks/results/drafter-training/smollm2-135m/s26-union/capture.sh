#!/usr/bin/env bash
# after session 26 (for a fresh machine, empty cache): session 23's capture command, leaving out the 26,453
# sequences already captured (seen-ids.txt.gz: the 23,354 the shipped h12's lineage trained on, plus the 3,099 of
# the s25/data2 cache, which only the unshipped h14 trained on). Run as OUT=/work/runs/sN/data MINUTES=M
HERE=$(cd "$(dirname "$0")" && pwd)
IDS=$HERE/seen-ids.txt.gz exec bash "$HERE/../s23-fresh-avx2/capture.sh"
