#!/usr/bin/env bash
# session 12: continue session 9's capture (same sources, same fixed pseudo-random order, same cache):
# new prompts only, the drafter is data-bound (train loss 2.2 vs validation 3.1 at 1.9 M tokens)
cd /work/runs
S=stdlib,chat:stdlib,humaneval,pysrc:torch,pysrc:pip,pysrc:setuptools,pysrc:_pytest,pysrc:huggingface_hub,\
pysrc:fsspec,pysrc:mpmath,pysrc:urllib3,pysrc:docutils,pysrc:PIL,pysrc:pyparsing,pysrc:IPython,pysrc:pydantic,\
pysrc:anyio,pysrc:aiohttp,pysrc:packaging,pysrc:openai,pysrc:numpy,pysrc:sympy,pysrc:networkx,pysrc:jinja2,\
pysrc:scipy,pysrc:requests,pysrc:flask,pysrc:click,pysrc:rich,pysrc:pygments,pysrc:attr,pysrc:werkzeug,pysrc:matplotlib
pydflash train --target smollm2-135m --prompts $S --limit 500 --out /work/runs/smollm2-s9 --layers 1 --block-size 8 \
  --max-new 192 --parallel 16 --step-rows 64 --threads 2 --capture-only --max-minutes ${MINUTES:-34} 2>&1 \
  | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
