#!/usr/bin/env bash
# session 26: the first capture for a Qwen2.5-Coder-0.5B drafter (issue #27, item 6), started once SmolLM2's curve
# had flattened. HumanEval 0-131 (plain and as chat requests; 132-163 are held out by the loader) and the SmolLM2
# recipe's sources (../../smollm2-135m/s15-new-prompts/capture.sh's list) at --limit ${LIMIT:-1777}, the target's
# default taps, 16 sequences in flight. Run as OUT=/work/runs/sN/qwen-data MINUTES=M; the same OUT continues (prompts
# already in its cache are skipped).
S=humaneval,chat:humaneval,stdlib,chat:stdlib,pysrc:torch,pysrc:pip,pysrc:setuptools,pysrc:_pytest,pysrc:huggingface_hub,\
pysrc:fsspec,pysrc:mpmath,pysrc:urllib3,pysrc:docutils,pysrc:PIL,pysrc:pyparsing,pysrc:IPython,pysrc:pydantic,\
pysrc:anyio,pysrc:aiohttp,pysrc:packaging,pysrc:openai,pysrc:numpy,pysrc:sympy,pysrc:networkx,pysrc:jinja2,\
pysrc:scipy,pysrc:requests,pysrc:flask,pysrc:click,pysrc:pygments,pysrc:attr,pysrc:werkzeug,pysrc:matplotlib,\
pysrc:fontTools,pysrc:dateutil,pysrc:Cython,pysrc:yaml,pysrc:pycparser,pysrc:cffi,pysrc:rich,\
pysrc:yarl,pysrc:pluggy,pysrc:scikit_build_core,pysrc:mesonpy,pysrc:reasoning_gym,pysrc:charset_normalizer
pydflash train --target qwen2.5-coder-0.5b --prompts $S --limit ${LIMIT:-1777} --out ${OUT:?} --layers 2 --block-size 8 \
  --max-new 192 --parallel 16 --step-rows 64 --threads 2 --capture-only --max-minutes ${MINUTES:-45} ${EXTRA_ARGS:-} 2>&1 \
  | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
