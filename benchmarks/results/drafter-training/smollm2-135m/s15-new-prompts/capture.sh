#!/usr/bin/env bash
# session 15 (fresh AVX2 machine, empty cache): new prompts for the shipped drafter. The session-12 sources
# with --limit 1234 (an even spread that rarely meets the 500-spread of sessions 9-14), humaneval 0-131 left
# out (all of it was captured before), plus packages never used before (licenses in the results README)
# (since session 22: OUT= and EXTRA_ARGS= for a fresh cache, e.g. --exclude-ids; since session 26: TARGET= and
# MORE_SOURCES=, sources put before these, for another target's capture)
S=${MORE_SOURCES:+$MORE_SOURCES,}stdlib,chat:stdlib,pysrc:torch,pysrc:pip,pysrc:setuptools,pysrc:_pytest,pysrc:huggingface_hub,\
pysrc:fsspec,pysrc:mpmath,pysrc:urllib3,pysrc:docutils,pysrc:PIL,pysrc:pyparsing,pysrc:IPython,pysrc:pydantic,\
pysrc:anyio,pysrc:aiohttp,pysrc:packaging,pysrc:openai,pysrc:numpy,pysrc:sympy,pysrc:networkx,pysrc:jinja2,\
pysrc:scipy,pysrc:requests,pysrc:flask,pysrc:click,pysrc:pygments,pysrc:attr,pysrc:werkzeug,pysrc:matplotlib,\
pysrc:fontTools,pysrc:dateutil,pysrc:Cython,pysrc:yaml,pysrc:pycparser,pysrc:cffi,pysrc:rich,\
pysrc:yarl,pysrc:pluggy,pysrc:scikit_build_core,pysrc:mesonpy,pysrc:reasoning_gym,pysrc:charset_normalizer
pydflash train --target ${TARGET:-smollm2-135m} --prompts $S --limit ${LIMIT:-1234} --out ${OUT:-/work/runs/s15/data} --layers 1 --block-size 8 \
  --max-new 192 --parallel 16 --step-rows 64 --threads 2 --capture-only --max-minutes ${MINUTES:-45} ${EXTRA_ARGS:-} 2>&1 \
  | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
