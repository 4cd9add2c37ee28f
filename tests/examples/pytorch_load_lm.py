"""Loads train_lm's checkpoint with PyTorch's own reader into a plain PyTorch model and
evaluates it on the test split.

    python pytorch_load_lm.py CKPT TEXT [EXPECTED_TEST_LOSS] [--hf HF_FILE]

CKPT: a folder that examples/train_lm saved (`--checkpoint-dir`) from its FSDP x TP model:
each rank's 2-D pieces, and `train_state.json` with the model's config and vocabulary.
TEXT: the text it trained on (data/lm_text.txt). The model is torchtitan's Llama
(torchtitan/models/llama3/model/model.py) cut down to what train_lm uses, written out here
so that nothing but torch is needed: the same FQNs and shapes, RMSNorm, rotary embeddings
in torchtitan's complex form (train_lm computes them in real arithmetic), causal
`scaled_dot_product_attention`, a SwiGLU feed-forward, no biases. A checkpoint of
`train_lm --moe` has MoE blocks in place of the feed-forward, as torchtitan's MoE
(torchtitan/models/common/moe.py) computes them: a sigmoid router choosing the top k experts
by score plus the load-balancing bias (ties toward the lower expert), the experts' SwiGLU
with 3-D weights, each weighted by its score, and the shared expert.

`dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(CKPT), no_dist=True)`
in this one process fills every tensor; the checkpoint must hold exactly the model's keys.
Then the test loss, computed as train_lm computes it (the last 10% of the text's byte
tokens, consecutive sequences of the training length, the mean next-token cross-entropy),
is printed as `pytorch_test_loss=X.XXXXXX`; with EXPECTED_TEST_LOSS (train_lm's
`test_loss=`), the two must agree within 1e-3, and the last line is `ok`.

With `--hf HF_FILE` (train_lm's `--hf-checkpoint`), the same model written as Hugging Face
writes it is loaded too, `load_state_dict(strict=True)` from the file: Llama's names and
rotary embeddings (`rotate_half`: each head's halves, not interleaved pairs), DeepSeek-V3's
MoE names (`mlp.gate`, its `e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj`,
`mlp.shared_experts`); its test loss is printed as `hf_test_loss=X.XXXXXX` and must agree
too.
"""

import json
import math
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    # [seq, head_dim / 2] -> [1, seq, 1, head_dim / 2]
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, -1)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads = c["n_heads"]
        self.head_dim = c["dim"] // c["n_heads"]
        self.wq = nn.Linear(c["dim"], c["dim"], bias=False)
        self.wk = nn.Linear(c["dim"], c["dim"], bias=False)
        self.wv = nn.Linear(c["dim"], c["dim"], bias=False)
        self.wo = nn.Linear(c["dim"], c["dim"], bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_forward(x, gate, top_k, expert, experts, shared):
    """torchtitan's MoE forward: sigmoid scores, the top `top_k` experts chosen by score plus
    the load-balancing bias (ties toward the lower expert), each expert's output (`expert(e,
    rows)`) weighted by its unbiased score, plus the shared expert."""
    weight, bias = gate
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(x @ weight.T)
    chosen = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, chosen)
    out = shared(x)
    for e in range(experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, expert(e, x[token]) * weights[token, slot].unsqueeze(1))
    return out.reshape(shape)


class Router(nn.Module):
    def __init__(self, dim, experts):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts))


class MoE(nn.Module):
    def __init__(self, dim, s):
        super().__init__()
        e, h = s["experts"], s["expert_hidden"]
        self.top_k = s["top_k"]
        self.router = Router(dim, e)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.empty(e, h, dim))
        self.experts.w2 = nn.Parameter(torch.empty(e, dim, h))
        self.experts.w3 = nn.Parameter(torch.empty(e, h, dim))
        self.shared_experts = FeedForward(dim, h)

    def forward(self, x):
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3

        def expert(e, rows):
            return (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T

        gate = (self.router.gate.weight, self.router.expert_bias)
        return moe_forward(x, gate, self.top_k, expert, w1.shape[0], self.shared_experts)


class TransformerBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c)
        if c.get("moe"):
            self.moe = MoE(c["dim"], c["moe"])
        else:
            self.feed_forward = FeedForward(c["dim"], c["hidden_dim"])
        self.attention_norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])
        self.ffn_norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c["vocab_size"], c["dim"])
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(c["dim"] // c["n_heads"], c["max_seq_len"], c["rope_theta"]),
            persistent=False,
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c["n_layers"])})
        self.norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])
        self.output = nn.Linear(c["dim"], c["vocab_size"], bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads = c["n_heads"]
        self.head_dim = c["dim"] // c["n_heads"]
        self.q_proj = nn.Linear(c["dim"], c["dim"], bias=False)
        self.k_proj = nn.Linear(c["dim"], c["dim"], bias=False)
        self.v_proj = nn.Linear(c["dim"], c["dim"], bias=False)
        self.o_proj = nn.Linear(c["dim"], c["dim"], bias=False)

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        q, k, v = (
            p(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = cos[:seqlen], sin[:seqlen]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class HfMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HfGate(nn.Module):
    def __init__(self, dim, experts):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


class HfMoE(nn.Module):
    def __init__(self, dim, s):
        super().__init__()
        self.top_k = s["top_k"]
        self.gate = HfGate(dim, s["experts"])
        self.experts = nn.ModuleList(
            HfMlp(dim, s["expert_hidden"]) for _ in range(s["experts"])
        )
        self.shared_experts = HfMlp(dim, s["expert_hidden"])

    def forward(self, x):
        gate = (self.gate.weight, self.gate.e_score_correction_bias)
        experts = self.experts
        return moe_forward(
            x, gate, self.top_k, lambda e, rows: experts[e](rows), len(experts), self.shared_experts
        )


class HfDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = HfAttention(c)
        if c.get("moe"):
            self.mlp = HfMoE(c["dim"], c["moe"])
        else:
            self.mlp = HfMlp(c["dim"], c["hidden_dim"])
        self.input_layernorm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class HfModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(HfDecoderLayer(c) for _ in range(c["n_layers"]))
        self.norm = nn.RMSNorm(c["dim"], eps=c["norm_eps"])


class HfForCausalLM(nn.Module):
    """Hugging Face's layout: `model.*` and `lm_head`, rotary tables as HF's Llama makes
    them (the frequencies repeated over both halves)."""

    def __init__(self, c):
        super().__init__()
        self.model = HfModel(c)
        self.lm_head = nn.Linear(c["dim"], c["vocab_size"], bias=False)
        head_dim = c["dim"] // c["n_heads"]
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(c["max_seq_len"]).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, tokens):
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h, self.cos, self.sin)
        return self.lm_head(self.model.norm(h))


def test_loss(model, inputs, targets):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in zip(inputs.split(32), targets.split(32)):
            logits = model(x)
            total += F.cross_entropy(
                logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
    return total / count


def main():
    args = sys.argv[1:]
    hf_file = None
    if "--hf" in args:
        at = args.index("--hf")
        hf_file = args[at + 1]
        del args[at : at + 2]
    ckpt, text_path = args[0], args[1]
    expected = float(args[2]) if len(args) > 2 else None
    torch.set_num_threads(1)
    with open(os.path.join(ckpt, "train_state.json")) as f:
        state = json.load(f)
    c = state["config"]

    # The tokens as data.rs makes them: the text's distinct bytes, ascending.
    with open(text_path, "rb") as f:
        text = f.read()
    vocab = sorted(set(text))
    assert vocab == state["vocab"], "the text's vocabulary is not the checkpoint's"
    assert len(vocab) == c["vocab_size"], (len(vocab), c["vocab_size"])
    index = {b: i for i, b in enumerate(vocab)}
    ids = torch.tensor([index[b] for b in text], dtype=torch.int64)
    test = ids[len(ids) * 9 // 10 :]
    seq = c["max_seq_len"]
    n = (len(test) - 1) // seq
    inputs = test[: n * seq].view(n, seq)
    targets = test[1 : n * seq + 1].view(n, seq)

    model = Transformer(c)
    sd = model.state_dict()
    saved = set(HuggingFaceStorageReader(ckpt).read_metadata().state_dict_metadata)
    assert saved == set(sd), (sorted(saved ^ set(sd)))
    # Poisoned first: every value must come from the checkpoint.
    with torch.no_grad():
        for t in sd.values():
            t.fill_(float("nan"))
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
    for k, t in sd.items():
        assert torch.isfinite(t).all(), f"{k} was not loaded"

    loss = test_loss(model, inputs, targets)
    print(f"loaded {len(sd)} tensors; uniform guess ln({len(vocab)}) = {math.log(len(vocab)):.4f}")
    print(f"pytorch_test_loss={loss:.6f}", flush=True)
    if expected is not None:
        assert abs(loss - expected) < 1e-3, f"PyTorch's test loss {loss} vs train_lm's {expected}"
    if hf_file is not None:
        from safetensors.torch import load_file

        hf = HfForCausalLM(c)
        hf.load_state_dict(load_file(hf_file), strict=True)
        hf_loss = test_loss(hf, inputs, targets)
        print(f"hf_test_loss={hf_loss:.6f}", flush=True)
        assert abs(hf_loss - loss) < 1e-4, f"HF's layout gives {hf_loss}, the checkpoint's {loss}"
    if expected is not None:
        print("ok", flush=True)


if __name__ == "__main__":
    main()
