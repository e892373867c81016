#!/usr/bin/env bash
# after session 25 (for a fresh machine, empty cache): session 23's capture command, leaving out the 23,354
# sequences h12 and its lineage trained on (trained-ids.txt.gz: session 24's list plus session 25's capture).
# Run as OUT=/work/runs/sN/data MINUTES=M
HERE=$(cd "$(dirname "$0")" && pwd)
IDS=$HERE/trained-ids.txt.gz exec bash "$HERE/../s23-fresh-avx2/capture.sh"
