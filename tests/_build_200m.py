
import gc, torch, zerodist
from torch.profiler import ProfilerActivity, profile
from zerodist.models import GPT, gpt_config
cfg = gpt_config('tiny', d_model=1024, d_ff=4096, n_layers=16, n_heads=8, seq_len=64)
torch.manual_seed(0)  # the same values on every rank: each rank keeps its shards, nothing is broadcast
with zerodist.zero.Init():
    model = GPT(cfg)
full = sum(p.numel() for p in model.parameters()) * 4
block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith('blocks.')) * 4
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    engine, *_ = zerodist.initialize(model=model, config={'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}},
                                     'zero_optimization': {'stage': 3, 'stage3_param_persistence_threshold': 0}})
    gc.collect()  # garbage in a reference cycle is not held: when the collector runs varies from run to run
events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == '[memory]')
live = peak = 0
for _, nbytes in events:
    live += nbytes
    peak = max(peak, live)
state = engine.model_state_bytes()
print(f"\nRESULT {full} {block} {root} {peak} {live} {state['params']} {state['grads']} {state['total']}", flush=True)
