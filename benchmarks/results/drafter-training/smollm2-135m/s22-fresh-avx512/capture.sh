#!/usr/bin/env bash
# session 22 (a fresh AVX-512 VNNI machine, empty cache): the session-15 sources with session 16's --limit 1777,
# minus the 15,121 sequences h8 (and every drafter before it) trained on, into a new cache. Run as MINUTES=30
S=stdlib,chat:stdlib,pysrc:torch,pysrc:pip,pysrc:setuptools,pysrc:_pytest,pysrc:huggingface_hub,\
pysrc:fsspec,pysrc:mpmath,pysrc:urllib3,pysrc:docutils,pysrc:PIL,pysrc:pyparsing,pysrc:IPython,pysrc:pydantic,\
pysrc:anyio,pysrc:aiohttp,pysrc:packaging,pysrc:openai,pysrc:numpy,pysrc:sympy,pysrc:networkx,pysrc:jinja2,\
pysrc:scipy,pysrc:requests,pysrc:flask,pysrc:click,pysrc:pygments,pysrc:attr,pysrc:werkzeug,pysrc:matplotlib,\
pysrc:fontTools,pysrc:dateutil,pysrc:Cython,pysrc:yaml,pysrc:pycparser,pysrc:cffi,pysrc:rich,\
pysrc:yarl,pysrc:pluggy,pysrc:scikit_build_core,pysrc:mesonpy,pysrc:reasoning_gym,pysrc:charset_normalizer
HERE=$(cd "$(dirname "$0")" && pwd)
pydflash train --target smollm2-135m --prompts $S --limit ${LIMIT:-1777} --out ${OUT:-/work/runs/s22/data} --layers 1 \
  --block-size 8 --max-new 192 --parallel 16 --step-rows 64 --threads 2 --capture-only --max-minutes ${MINUTES:-30} \
  --exclude-ids "$HERE/../s20-more-prompts/trained-ids.txt.gz" 2>&1 \
  | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
