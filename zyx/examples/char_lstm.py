"""Character-level LSTM language model: ``python -m zyx.examples.char_lstm --steps 200``.

The text is the source of a Python standard-library module (`os` by default, read from
``os.__file__``), so the example runs anywhere Python does, offline. The model is the
classic one: an Embedding of the characters, an nn.LSTM, a Linear head predicting the next
character; the loop is PyTorch's, fed by a DataLoader over (input, target) windows:

    for x, y in loader:
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(); loss.backward(); nn.utils.clip_grad_norm_(params, 1.0); opt.step()

Prints the loss and the time per step every `--log-every` steps, then a sample of
generated text (greedy with temperature sampling) and writes a checkpoint with --save.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time

import numpy as np

import zyx
from zyx import nn
import zyx.nn.functional as F
from zyx.utils.data import DataLoader, Dataset


def load_text(module_name: str = "os") -> str:
    """The source text of a standard-library module (ships with every Python)."""
    return inspect.getsource(importlib.import_module(module_name))


class CharWindows(Dataset):
    """Windows of seq_len characters (as int64 codes) and the same window shifted by one:
    sample i starts at character i * stride."""

    def __init__(self, codes: np.ndarray, seq_len: int, stride: int | None = None):
        self.codes, self.seq_len = codes, seq_len
        self.stride = stride or seq_len
        self.n = (len(codes) - seq_len - 1) // self.stride + 1
        if self.n <= 0:
            raise ValueError(f"text of {len(codes)} characters is shorter than one window "
                             f"of {seq_len + 1}")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range for {self.n} windows")
        s = i * self.stride
        return self.codes[s:s + self.seq_len], self.codes[s + 1:s + self.seq_len + 1]


class CharLSTM(nn.Module):
    """Embedding -> LSTM (batch_first) -> Linear over the vocabulary."""

    def __init__(self, vocab: int, embed: int = 32, hidden: int = 128, layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, state=None):
        out, state = self.lstm(self.embed(x), state)
        return self.head(out), state


def sample(model, stoi, itos, prompt: str, length: int, temperature: float = 0.8,
           seed: int = 0) -> str:
    """Continue `prompt` by `length` characters drawn from the model's distribution."""
    rng = np.random.default_rng(seed)
    model.eval()
    with zyx.no_grad():
        codes = [stoi.get(c, 0) for c in prompt] or [0]
        logits, state = model(zyx.tensor(np.array([codes], np.int64)))
        out = []
        for _ in range(length):
            p = F.softmax(logits[0, -1] / temperature, dim=-1).numpy().astype(np.float64)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
            out.append(itos[nxt])
            logits, state = model(zyx.tensor(np.array([[nxt]], np.int64)), state)
    model.train()
    return prompt + "".join(out)


def train(text: str, steps: int = 200, batch_size: int = 32, seq_len: int = 30,
          hidden: int = 128, lr: float = 3e-3, log_every: int = 20, seed: int = 0, out=sys.stdout):
    """Train for `steps` optimizer steps (cycling over the data); returns a dict with the
    model, the vocabulary, the per-step losses and step times."""
    zyx.manual_seed(seed)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    codes = np.array([stoi[c] for c in text], np.int64)
    data = CharWindows(codes, seq_len)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=np.random.default_rng(seed))
    model = CharLSTM(len(chars), hidden=hidden)
    params = list(model.parameters())
    opt = zyx.optim.Adam(params, lr=lr)
    losses, times = [], []
    step = 0
    print(f"text: {len(text)} characters, vocabulary {len(chars)}, {len(data)} windows of "
          f"{seq_len}; LSTM hidden {hidden}, batch {batch_size}", file=out)
    while step < steps:
        for x, y in loader:
            t0 = time.perf_counter()
            logits, _ = model(x)
            loss = F.cross_entropy(logits.reshape(-1, len(chars)), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            value = loss.item()
            times.append(time.perf_counter() - t0)
            losses.append(value)
            step += 1
            if step == 1 or step % log_every == 0 or step == steps:
                recent = sorted(times[-log_every:])
                print(f"step {step:5d}  loss {value:.4f}  step time "
                      f"{recent[len(recent) // 2] * 1e3:.1f} ms (median of last "
                      f"{len(recent)}; the first step compiles: {times[0]:.2f} s)", file=out)
            if step >= steps:
                break
    return {"model": model, "opt": opt, "stoi": stoi, "itos": chars, "losses": losses,
            "times": times}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--module", default="os", help="standard-library module whose source "
                    "is the training text")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--sample", type=int, default=200, help="characters to generate after "
                    "training (0: none)")
    ap.add_argument("--save", help="write a checkpoint (model, optimizer, vocabulary) here")
    args = ap.parse_args(argv)
    text = load_text(args.module)
    res = train(text, args.steps, args.batch_size, args.seq_len, args.hidden, args.lr,
                args.log_every)
    if args.sample:
        print("---- sample ----")
        print(sample(res["model"], res["stoi"], res["itos"], "def ", args.sample))
    if args.save:
        zyx.save({"model": res["model"].state_dict(), "optim": res["opt"].state_dict(),
                  "vocab": "".join(res["itos"]), "steps": len(res["losses"])}, args.save)
        print(f"checkpoint written to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
