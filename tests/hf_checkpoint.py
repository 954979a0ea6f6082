"""Tiny random Hugging Face checkpoints of the families `pi2-gguf import` knows, written as those models
ship them (config.json with their keys, model.safetensors, a sentencepiece tokenizer.model), and a numpy
forward pass of the same weights with the Hugging Face conventions (rotate-half RoPE on the unpermuted
q/k projections, GQA, the family's FFN activation): the reference the imported GGUF is checked against."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT = ("The history of the Roman Empire covers the history of ancient Rome from the fall of the Roman "
        "Republic in 27 BC until the abdication of Romulus Augustulus in AD 476 in the West. Rome had begun "
        "expanding shortly after the founding of the republic in the 6th century BC, though it did not expand "
        "outside the Italian peninsula until the 3rd century BC. Civil war engulfed the Roman state in the "
        "mid 1st century BC, first between Julius Caesar and Pompey, and finally between Octavian and Mark "
        "Antony. Antony was defeated at the Battle of Actium in 31 BC, leading to the annexation of Egypt. ")


@dataclass(frozen=True)
class Family:
    name: str           # test id
    architectures: str  # config.json "architectures"[0]
    model_type: str
    hidden_act: str
    extra: dict         # further config.json keys the real models ship
    qkv_bias: bool = False
    predictors: bool = False  # mlp.predictor.fc1/fc2 as Bamboo/TurboSparse ship them


FAMILIES = {f.name: f for f in (
    Family("bamboo", "BambooForCausalLM", "bamboo", "relu", {"sliding_window": None}, predictors=True),
    Family("prosparse", "SparseLlamaForCausalLM", "sparsellama", "fatrelu", {"hidden_act_param": 0.01}),
    Family("relullama", "LlamaForCausalLM", "llama", "relu", {"pretraining_tp": 1}),
    Family("sparseqwen2", "Qwen2ForCausalLM", "qwen2", "relu",
           {"use_sliding_window": False, "max_window_layers": 2}, qkv_bias=True),
)}
SHAPE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256}
PREDICTOR_RANK = 16


def _tokenizer(d: Path) -> int:
    """A sentencepiece model trained on TEXT (BPE, byte fallback: every string has tokens); its size."""
    import sentencepiece as spm

    corpus = d / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 8)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(d / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   hard_vocab_limit=False, minloglevel=2, bos_id=1, eos_id=2, unk_id=0)
    corpus.unlink()
    (d / "tokenizer.vocab").unlink()
    return spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")).get_piece_size()


def write(d: Path, family: Family, seed: int = 0, exact_predictors: bool = False) -> dict[str, np.ndarray]:
    """Writes the checkpoint into directory d; returns its tensors (float32). Predictors (families that ship
    them): random, or with exact_predictors fc1 = [I; -I], fc2 = [G, -G], whose output is the gate
    pre-activation G x itself (relu(x) - relu(-x) = x)."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    n_vocab = _tokenizer(d)
    rng = np.random.default_rng(seed)
    h, f = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    hd = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * hd

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(n_vocab, h, 8.0),
                                "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
                                "lm_head.weight": mat(n_vocab, h, 4.0)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        for name, rows in (("q", h), ("k", kv), ("v", kv)):
            t[p + f"self_attn.{name}_proj.weight"] = mat(rows, h, 2.0)
            if family.qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        t[p + "self_attn.o_proj.weight"] = mat(h, h)
        # a negative mean on gate (and up) leaves most neurons idle, as in the trained sparse models
        t[p + "mlp.gate_proj.weight"] = mat(f, h, 2.0) - 0.02
        t[p + "mlp.up_proj.weight"] = mat(f, h, 2.0)
        t[p + "mlp.down_proj.weight"] = mat(h, f)
        if family.predictors and exact_predictors:
            eye = np.eye(h, dtype=np.float32)
            gate = t[p + "mlp.gate_proj.weight"]
            t[p + "mlp.predictor.fc1.weight"] = np.concatenate([eye, -eye])
            t[p + "mlp.predictor.fc2.weight"] = np.concatenate([gate, -gate], axis=1)
        elif family.predictors:
            t[p + "mlp.predictor.fc1.weight"] = mat(PREDICTOR_RANK, h)
            t[p + "mlp.predictor.fc2.weight"] = mat(f, PREDICTOR_RANK)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": [family.architectures], "model_type": family.model_type,
              "hidden_act": family.hidden_act, "vocab_size": n_vocab, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "torch_dtype": "float32", "initializer_range": 0.02, **SHAPE,
              **family.extra}
    (d / "config.json").write_text(json.dumps(config, indent=2))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False,
                                                          "bos_token": "<s>", "eos_token": "</s>",
                                                          "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}))
    return t


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x [n_tok, n_head, hd]: Hugging Face's rotate_half RoPE at positions 0..n_tok-1."""
    n, _, hd = x.shape
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(n), inv)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def activation(family: Family, g: np.ndarray, u: np.ndarray, config: dict) -> np.ndarray:
    if family.hidden_act == "silu":
        return g / (1 + np.exp(-g)) * u
    if family.architectures == "BambooForCausalLM":
        return np.maximum(g, 0) * np.maximum(u, 0)
    if family.hidden_act == "fatrelu":
        return np.where(g > config["hidden_act_param"], g, 0) * u
    return np.maximum(g, 0) * u


def forward(d: Path, family: Family, tokens: list[int]) -> np.ndarray:
    """Logits [n_tok, n_vocab] of the checkpoint in directory d for tokens at positions 0.. (float64)."""
    from safetensors.numpy import load_file

    t = {k: v.astype(np.float64) for k, v in load_file(str(d / "model.safetensors")).items()}
    c = json.loads((d / "config.json").read_text())
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // nh
    n = len(tokens)
    x = t["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], c["rms_norm_eps"])

        def proj(name: str) -> np.ndarray:
            y = h @ t[p + f"self_attn.{name}_proj.weight"].T
            return y + t[p + f"self_attn.{name}_proj.bias"] if family.qkv_bias else y

        q = _rope(proj("q").reshape(n, nh, hd), c["rope_theta"])
        k = _rope(proj("k").reshape(n, nkv, hd), c["rope_theta"])
        v = proj("v").reshape(n, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(x, t[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        a = activation(family, h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T, c)
        x = x + a @ t[p + "mlp.down_proj.weight"].T
    return _rms(x, t["model.norm.weight"], c["rms_norm_eps"]) @ t["lm_head.weight"].T
