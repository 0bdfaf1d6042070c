import torch, flashinfer, math
torch.manual_seed(0)
dev = "cuda"
heads, kv_heads, d, page = 4, 2, 64, 16
n = 50
q = torch.randn(n, heads, d, device=dev, dtype=torch.bfloat16)
k = torch.randn(n, kv_heads, d, device=dev, dtype=torch.bfloat16)
v = torch.randn(n, kv_heads, d, device=dev, dtype=torch.bfloat16)
pages = (n + page - 1) // page
kc = torch.zeros(pages * page, kv_heads, d, device=dev, dtype=torch.bfloat16); kc[:n] = k
vc = torch.zeros_like(kc); vc[:n] = v
ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
w.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
       torch.arange(pages, dtype=torch.int32, device=dev), torch.tensor([n - (pages - 1) * page], dtype=torch.int32),
       num_qo_heads=heads, num_kv_heads=kv_heads, head_dim_qk=d, page_size=page, causal=True,
       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
out, lse = w.run(q, (kc.view(pages, page, kv_heads, d), vc.view(pages, page, kv_heads, d)), return_lse=True)
kk = k.float().repeat_interleave(2, 1); s = torch.einsum("qhd,khd->hqk", q.float(), kk) / math.sqrt(d)
mask = torch.ones(n, n, device=dev, dtype=torch.bool).tril()
s = s.masked_fill(~mask, float("-inf"))
ln = s.logsumexp(-1).T
print("lse shape", lse.shape, "natural err", (lse - ln).abs().max().item(), "base2 err", (lse - ln / math.log(2)).abs().max().item())
