# Where auto's time goes with and without the drafter (session 20): HumanEval 132-147, one fresh process per
# (prompt, mode), modes alternated, Stats timers summed. Run: python where_the_time_goes.py (from outside the checkout)
import json, os, subprocess, sys, tempfile
if len(sys.argv) > 1:
    from pydflash import Engine
    from pydflash.fetch import prompt_sets as prompts
    idx, mode = int(sys.argv[1]), sys.argv[2]
    p = prompts.load("humaneval", limit=1, offset=132 + idx)[0]
    with Engine("smollm2-135m", "auto" if mode == "auto" else None, n_threads=2, n_max="auto", lookup=2) as e:
        r = e.generate(p.render(e.target), max_tokens=128, temperature=0, ignore_eos=True)
        s = r.stats
        print(json.dumps({k: getattr(s, k) for k in ("t_draft_ms", "t_verify_ms", "t_accept_ms", "t_total_ms",
              "n_verify_steps", "n_drafted", "n_accepted", "n_lookup_drafted", "n_lookup_accepted", "n_trimmed")}))
    sys.exit(0)
tot = {}
for i in range(16):
    for mode in (("auto", "history") if i % 2 == 0 else ("history", "auto")):
        env = dict(os.environ, PYDFLASH_AUTOTUNE_CACHE="0", XDG_CACHE_HOME=tempfile.mkdtemp())
        out = subprocess.run([sys.executable, __file__, str(i), mode], env=env, capture_output=True, text=True)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        t = tot.setdefault(mode, {})
        for k, v in d.items():
            t[k] = t.get(k, 0) + v
for m, t in tot.items():
    print(m, {k: round(v, 1) for k, v in t.items()})
