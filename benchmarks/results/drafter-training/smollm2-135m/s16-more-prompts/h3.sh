#!/usr/bin/env bash
# session 16: the shipped weights (h2, step 33,781, the committed portable checkpoint) continued on the session-15
# and session-16 captures together (1.66 M tokens; /work/runs/s16/h3/cache links to the session-15 cache), h2's
# options, a new schedule peaking at 3e-4. Run as STEPS=38450 MINUTES=55
RUN=/work/runs/s16/h3 exec bash "$(dirname "$0")/../s15-new-prompts/h2.sh"
