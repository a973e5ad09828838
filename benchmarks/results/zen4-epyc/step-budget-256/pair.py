import os, sys, time, random, statistics
os.environ["HF_HUB_OFFLINE"]="1"
from pagellm import LLM, SamplingParams
q=sys.argv[1]=="int8"; reps=int(sys.argv[2]); maxtok=int(sys.argv[3]); n=int(sys.argv[4])
llms={b: LLM(quantize_activations=q, max_num_batched_tokens=b, enable_prefix_caching=False) for b in (512,256)}
rng=random.Random(0)
prompts=[{"prompt_token_ids":[rng.randrange(100,40000) for _ in range(1024)]} for _ in range(n)]
sp=SamplingParams(max_tokens=maxtok, temperature=0, ignore_eos=True)
for l in llms.values(): l.generate(prompts[:1], sp, use_tqdm=False)
res={512:[],256:[]}
for r in range(reps):
    for b,l in (list(llms.items()) if r%2==0 else list(llms.items())[::-1]):
        t=time.perf_counter(); l.generate(prompts, sp, use_tqdm=False); res[b].append(time.perf_counter()-t)
for b,v in res.items(): print(b, [round(x,2) for x in v], "median", round(statistics.median(v),3))
print("ratio 256/512 per pair", [round(a/b,3) for a,b in zip(res[256],res[512])])
