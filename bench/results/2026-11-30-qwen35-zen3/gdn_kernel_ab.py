import sys, time, statistics
from engine import LLM, SamplingParams
from engine.models import gated_delta_net
path = sys.argv[1]
llm = LLM(path, max_model_len=2048)
prompt = list(range(100, 600))
orig = gated_delta_net.decode_kernels
def run(k):
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t
res = {"kernel": [], "torch": []}
for rnd in range(4):
    for name in ("kernel", "torch"):
        gated_delta_net.decode_kernels = orig if name == "kernel" else (lambda *a, **k: None)
        a = run(1); b = run(33)
        res[name].append((b - a) / 32 * 1000)
for k, v in res.items(): print(k, "median step ms", round(statistics.median(v), 1), [round(x, 1) for x in v])
print("ratio torch/kernel", round(statistics.median(res["torch"]) / statistics.median(res["kernel"]), 2))
