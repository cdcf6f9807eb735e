# Does LibTorch's CPU sampling give other tokens at another intra-op thread count? Issue 29:
# split generation (workers with a share of the cores) sampled other text than one process.
# Draws what loom's generate drew (softmax, top-p, multinomial from a seeded generator) at 1, 8
# and 16 threads, and the ops it builds on, and prints which differ.
import torch

torch.manual_seed(0)
logits = torch.randn(2, 259) * 3
def sample(threads):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(8):
        probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, -1)
        s, order = probs.sort(-1, descending=True)
        s = s.masked_fill((s.cumsum(-1) - s) > 0.9, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, s)
        out.append(torch.multinomial(probs, 1, False, generator=gen).squeeze(-1).tolist())
    return out
def exponential(threads, n):
    torch.set_num_threads(threads)
    return torch.empty(n).exponential_(1, generator=torch.Generator().manual_seed(5))
def matmul(threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 64, generator=g), torch.randn(259, 64, generator=g)
    return torch.nn.functional.linear(x, w)
print("torch", torch.__version__, "mkl", torch.backends.mkl.is_available(), "cpu capability", torch.backends.cpu.get_cpu_capability())
base = sample(16)
for t in (1, 8):
    print(f"multinomial tokens at {t} vs 16 threads:", "same" if sample(t) == base else "DIFFER")
for n in (518, 4000, 100000):
    e16 = exponential(16, n)
    for t in (1, 8):
        print(f"exponential_ of {n} at {t} vs 16 threads:", "same" if torch.equal(exponential(t, n), e16) else "DIFFER")
m16 = matmul(16)
for t in (1, 8):
    print(f"linear [2,64]x[64,259] at {t} vs 16 threads:", "same" if torch.equal(matmul(t), m16) else "DIFFER")
