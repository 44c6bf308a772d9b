"""Issue 31's transformer language model, written as a PyTorch user writes it.

Every function here takes the library as its first argument, named `torch`, and its body is
plain PyTorch code: passing zyx instead of torch is the one change (`import zyx as torch`).
bench_recipes.py times both in one process; run as a script, it trains a few steps with
each and prints the step times:

    python benches/recipe_lm.py [steps]          (zyx on its default device, ZYX_DEVICE)

The model: a 2-layer pre-norm transformer (d 128, 4 heads, feed-forward 512, GELU, dropout
0.1) over 65 characters with learned positions up to T = 64; batch 32; cross-entropy over
every position; AdamW; gradients clipped to norm 1. Batches are `stack`s of slices of one
text tensor at random starts (`get_batch`), as nanoGPT's."""
import sys
import time

import numpy as np

VOCAB, D, HEADS, FF, LAYERS, B, T, DROPOUT = 65, 128, 4, 512, 2, 32, 64, 0.1
LR, CLIP = 3e-4, 1.0


def text_codes(n=20000, seed=0):
    """A fixed stand-in for a character corpus: n codes below VOCAB."""
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int64)


def make_model(torch, device):
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.pos = nn.Embedding(T, D)
            layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=DROPOUT,
                                               activation="gelu", batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, VOCAB)

        def forward(self, idx):
            n = idx.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
            pos = torch.arange(n, device=idx.device)
            x = self.tok(idx) + self.pos(pos)
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

    return LM().to(device)


def make_step(torch, model):
    """One training step on a batch (x, y): forward, loss, backward, clipping, AdamW."""
    F = torch.nn.functional
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return loss
    return step


def batcher(torch, codes, device):
    data = torch.tensor(codes, dtype=torch.long, device=device)

    def get_batch():
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i:i + T] for i in ix])
        y = torch.stack([data[i + 1:i + T + 1] for i in ix])
        return x, y
    return get_batch


def generate(torch, model, idx, new_tokens):
    """nanoGPT's sampling loop, greedy (argmax, so two libraries write the same text):
    the context is cropped to T, the new token appended with cat."""
    F = torch.nn.functional
    model.eval()
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(idx[:, -T:])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            nxt = torch.argmax(probs, dim=-1, keepdim=True)
            idx = torch.cat((idx, nxt), dim=1)
    return idx


def train(torch, device, steps, codes=None):
    """The whole script: seed, data, model, `steps` steps; the step times (s) and the last
    loss."""
    torch.manual_seed(1337)
    get_batch = batcher(torch, text_codes() if codes is None else codes, device)
    model = make_model(torch, device)
    model.train()
    step = make_step(torch, model)
    times, loss = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        xb, yb = get_batch()
        loss = step(xb, yb).item()
        times.append(time.perf_counter() - t0)
    return times, loss


if __name__ == "__main__":
    import zyx
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    dev = zyx.get_default_device()
    zt, zl = train(zyx, dev, n)
    print(f"zyx   ({dev}): first step {zt[0] * 1e3:.0f} ms, then median "
          f"{np.median(zt[3:]) * 1e3:.2f} ms, last loss {zl:.3f}")
    try:
        import torch as real_torch
    except ImportError:
        sys.exit(0)
    tdev = "cuda" if real_torch.cuda.is_available() else "cpu"
    tt, tl = train(real_torch, tdev, n)
    print(f"torch ({tdev}): first step {tt[0] * 1e3:.0f} ms, then median "
          f"{np.median(tt[3:]) * 1e3:.2f} ms, last loss {tl:.3f}")
