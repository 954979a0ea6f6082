"""Tiny random Hugging Face checkpoints of 17 model families, converted to GGUF by llama.cpp's own converter
(convert_hf_to_gguf.py from the pinned llama-cpp-python sdist, unpatched): what stock llama.cpp makes of each
architecture, for checking the plugin against it per architecture.

    from tiny_families import FAMILIES, build, build_many
    path = build("qwen3moe", tmp_dir, "q8_0")                     # one GGUF
    paths = build_many(list(FAMILIES), tmp_dir, ("f32", "q8_0"))  # many, in one converter process

Each checkpoint is the family's transformers model class (`from_config`, seeded) with the keys its real
models ship in config.json, saved with save_pretrained; SmallThinker, which transformers has no class for, is
written by hand with the official SmallThinker-4BA0.6B's config keys and tensor names. Weights are then redrawn
so that activations are not degenerate (HF's std 0.02 init gives near-uniform logits): linear weights
~N(0, 1/fan_in), embeddings ~N(0, 1) (small where tied to the output, see _redraw), norms ~1, routers sharp
enough that tokens pick different experts; greedy decoding then varies from token to token, and transformers'
forward pass greedy-decodes the same tokens as stock llama.cpp on the f32 GGUF.
The tokenizer is hf_checkpoint's small sentencepiece model for every family (see tiny_families_convert.py).

Checkpoints and GGUFs are kept under out_dir by a key of the family's definition and the seed, written under a
temporary name and renamed when complete, and reused when present. Building needs the `import` extra (torch,
transformers, sentencepiece, safetensors); it runs in a subprocess, so the caller never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))  # hf_checkpoint beside this file, also when imported by path
from hf_checkpoint import _tokenizer  # noqa: E402

if TYPE_CHECKING:
    import torch

OUTTYPES = ("f32", "f16", "q8_0")  # the converter's own --outtype values
# bump when the weights or the files written change without a family's definition changing (cache key)
LAYOUT_VERSION = 1
DROP = "<not in config.json>"  # a family's value for a SHAPE key its real models do not ship
# every dimension a quantized row has is a multiple of 32 (Q8_0's block)
SHAPE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "rms_norm_eps": 1e-6,
                         "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class TinyFamily:
    name: str
    config_class: str | None  # the transformers config class; None: config.json and weights written by hand
    config: dict[str, Any] = field(hash=False)  # keys beyond SHAPE, as the family's real models ship them
    arch: str = ""            # the GGUF's general.architecture
    moe: bool = False
    shared_experts: bool = False  # ffn_{gate,up,down}_shexp beside the routed experts
    gated: bool = True        # the FFN has a gate (a GLU); starcoder2's is up -> GELU -> down
    # the ggml op llama.cpp's graph applies in the (routed) FFN: a GLU (swiglu, geglu, reglu, swiglu_oai) or,
    # without a gate, the unary op (gelu)
    act: str = "swiglu"
    fused_gate_up: bool = False  # phi3: gate and up as one ffn_up of 2*n_ff rows, split by the graph
    ffn_bias: bool = False    # FFN / expert biases (starcoder2, gpt-oss)
    dense_lead: int = 0       # leading layers with a dense FFN in an MoE (first_k_dense_replace)
    norm_plus_one: bool = False  # gemma: a norm scales by (1 + w), so w is drawn around 0; the input embedding
    #                              is scaled by sqrt(hidden)
    added_tokens: tuple[str, ...] = ()  # tokens the real tokenizer adds after the sentencepiece vocabulary

    @property
    def n_layer(self) -> int:
        return int(self.config.get("num_hidden_layers", SHAPE["num_hidden_layers"]))

    def key(self, seed: int) -> str:
        """What names this family's files under out_dir: its definition, the seed, LAYOUT_VERSION."""
        blob = json.dumps([asdict(self), SHAPE, seed, LAYOUT_VERSION], sort_keys=True, default=str)
        return f"{self.name}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"

    def ffn_tensors(self, layer: int) -> set[str]:
        """The blk.{layer}.ffn_* tensors (weights and biases, norms excluded) llama.cpp's converter writes."""
        moe = self.moe and layer >= self.dense_lead
        if moe:
            names = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
            if self.ffn_bias:
                names |= {"ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"}
            if self.shared_experts:
                names |= {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
            if self.name == "qwen2moe":
                names.add("ffn_gate_inp_shexp.weight")  # the shared expert's sigmoid gate
            if self.name == "glm4moe":
                names.add("exp_probs_b.bias")  # e_score_correction_bias: biases the selection only
            return names
        names = {"ffn_up.weight", "ffn_down.weight"}
        if self.gated and not self.fused_gate_up:
            names.add("ffn_gate.weight")
        if self.ffn_bias:
            names |= {"ffn_up.bias", "ffn_down.bias"}
        return names


def _fam(name: str, config_class: str | None, arch: str, **kw: Any) -> TinyFamily:
    flags = {k: kw.pop(k) for k in list(kw) if k in TinyFamily.__dataclass_fields__}
    return TinyFamily(name, config_class, kw, arch, **flags)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    # Llama-3.2-1B's layout: llama3 RoPE scaling (the converter writes rope_freqs), GQA, tied embeddings
    _fam("llama", "LlamaConfig", "llama", intermediate_size=192, head_dim=16, rope_theta=500000.0,
         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=True, mlp_bias=False,
         attention_bias=False, pretraining_tp=1),
    _fam("mistral", "MistralConfig", "llama", rope_theta=1e6, sliding_window=None, tie_word_embeddings=False),
    _fam("qwen2", "Qwen2Config", "qwen2", rope_theta=1e6, use_sliding_window=False, max_window_layers=2,
         tie_word_embeddings=True),
    # Qwen3's head_dim is not hidden/heads (q_proj has 128 rows here); q/k norms
    _fam("qwen3", "Qwen3Config", "qwen3", intermediate_size=192, head_dim=32, rope_theta=1e6,
         use_sliding_window=False, max_window_layers=2, tie_word_embeddings=True, attention_bias=False),
    _fam("gemma2", "Gemma2Config", "gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=4096,
         attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
         rope_theta=10000.0, tie_word_embeddings=True, norm_plus_one=True, act="geglu"),
    # Gemma-3-1B's layout: head_dim independent of hidden/heads, local/global RoPE bases, sliding window
    _fam("gemma3", "Gemma3TextConfig", "gemma3", head_dim=32, query_pre_attn_scalar=32, sliding_window=512,
         rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, hidden_activation="gelu_pytorch_tanh",
         final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True, norm_plus_one=True,
         act="geglu"),
    # Phi-3-mini-4k's layout: fused qkv_proj and gate_up_proj; its added tokens (llama.cpp's vocabulary loader
    # looks <|endoftext|> up in a model named phi3)
    _fam("phi3", "Phi3Config", "phi3", original_max_position_embeddings=4096, sliding_window=2047,
         rope_theta=10000.0, rope_scaling=None, pad_token_id=None, tie_word_embeddings=False, fused_gate_up=True,
         added_tokens=("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                       "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>",
                       "<|user|>")),
    # StarCoder2-3B's layout: LayerNorm, biases everywhere, c_fc -> GELU -> c_proj
    _fam("starcoder2", "Starcoder2Config", "starcoder2", intermediate_size=256, use_bias=True,
         hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, rms_norm_eps=DROP, sliding_window=4096,
         rope_theta=999999.4420358813, tie_word_embeddings=True, gated=False, ffn_bias=True, act="gelu"),
    _fam("mixtral", "MixtralConfig", "llama", num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
         sliding_window=None, tie_word_embeddings=False, moe=True),
    _fam("qwen3moe", "Qwen3MoeConfig", "qwen3moe", intermediate_size=192, moe_intermediate_size=64,
         num_experts=8, num_experts_per_tok=2, head_dim=32, norm_topk_prob=True, decoder_sparse_step=1,
         mlp_only_layers=[], rope_theta=1e6, use_sliding_window=False, tie_word_embeddings=False, moe=True),
    # Qwen1.5-MoE-A2.7B's layout: a shared expert gated by sigmoid(shared_expert_gate x), qkv biases
    _fam("qwen2moe", "Qwen2MoeConfig", "qwen2moe", moe_intermediate_size=64, shared_expert_intermediate_size=128,
         num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
         rope_theta=1e6, use_sliding_window=False, tie_word_embeddings=False, moe=True, shared_experts=True),
    # OLMoE-1B-7B's layout: no GQA (llama.cpp's olmoe reads q/k norms of n_embd), softmax routing without
    # renormalization
    _fam("olmoe", "OlmoeConfig", "olmoe", num_key_value_heads=4, intermediate_size=64, rms_norm_eps=1e-5,
         num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None, rope_theta=10000.0,
         tie_word_embeddings=False, moe=True),
    # granite-3.0-1b-a400m's layout: fused input_linear experts, the four multipliers (attention's is 1/head_dim)
    _fam("granitemoe", "GraniteMoeConfig", "granitemoe", intermediate_size=64, num_local_experts=8,
         num_experts_per_tok=2, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
         attention_multiplier=1 / 16, rope_theta=10000.0, tie_word_embeddings=True, moe=True),
    # gpt-oss-20b's layout: attention sinks and biases, alternating sliding/full attention, YaRN, expert biases,
    # interleaved gate_up (here unquantized: the converter writes it in --outtype, not MXFP4)
    _fam("gpt_oss", "GptOssConfig", "gpt-oss", intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
         head_dim=16, sliding_window=128, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
         rope_theta=150000.0, rope_scaling=GPT_OSS_ROPE, max_position_embeddings=131072,
         tie_word_embeddings=False, moe=True, ffn_bias=True, act="swiglu_oai"),
    # DeepSeek-V2-Lite's layout: no q_lora_rank (q_proj), MLA, layer 0 dense, shared experts. llama.cpp reads a
    # GGUF without attention.q_lora_rank only at V2-Lite's 26/27 layers (deepseek2.cpp, is_lite), so 27 here.
    _fam("deepseek2", "DeepseekV2Config", "deepseek2", num_hidden_layers=27, num_key_value_heads=4,
         q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
         moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
         first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
         scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0, rope_theta=10000.0,
         tie_word_embeddings=False, moe=True, shared_experts=True, dense_lead=1),
    # GLM-4.5-Air's layout: layer 0 dense, a shared expert, sigmoid routing with e_score_correction_bias,
    # partial RoPE, qkv biases; without its MTP layer (transformers' class has none to save)
    _fam("glm4moe", "Glm4MoeConfig", "glm4moe", num_hidden_layers=3, intermediate_size=192, head_dim=32,
         moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
         first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
         partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, rope_theta=10000.0,
         tie_word_embeddings=False, moe=True, shared_experts=True, dense_lead=1),
    # SmallThinker-4BA0.6B's config.json keys (no moe_primary_router_apply_softmax there: sigmoid routing) and
    # tensor names (block_sparse_moe.primary_router, experts.N.{up,gate,down}); the router reads the layer input
    _fam("smallthinker", None, "smallthinker", moe_ffn_hidden_size=64, moe_num_primary_experts=8,
         moe_num_active_primary_experts=2, head_dim=16, rope_theta=1.5e6, sliding_window_size=4096,
         norm_topk_prob=True, tie_word_embeddings=True, moe=True, act="reglu"),
)}


def _hf_config(fam: TinyFamily, n_vocab: int) -> Any:
    import transformers

    cls = getattr(transformers, fam.config_class or "")
    kw = {**SHAPE, "vocab_size": n_vocab, "dtype": "float32", **fam.config}
    return cls(**{k: v for k, v in kw.items() if v != DROP})


def _smallthinker_config(fam: TinyFamily, n_vocab: int) -> dict[str, Any]:
    """config.json as SmallThinker-4BA0.6B-Instruct ships it, at the tiny shape."""
    c = {**SHAPE, **fam.config}
    n = c["num_hidden_layers"]
    for k in ("intermediate_size",):  # not a SmallThinker key: its experts' size is moe_ffn_hidden_size
        c.pop(k)
    return {"architectures": ["SmallThinkerForCausalLM"], "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_smallthinker.SmallThinkerConfig",
                         "AutoModel": "modeling_smallthinker.SmallThinkerForCausalLM",
                         "AutoModelForCausalLM": "modeling_smallthinker.SmallThinkerForCausalLM"},
            "initializer_range": 0.02, "max_length": None, "model_name": "smallthinker_tiny",
            "model_type": "smallthinker", "output_router_logits": False, "repetition_penalty": None,
            "rope_layout": [1] * n, "rope_scaling": None, "sliding_window_layout": [0] * n, "temperature": None,
            "top_p": None, "torch_dtype": "float32", "use_cache": False, "vocab_size": n_vocab, **c}


def _smallthinker_tensors(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    import torch

    h, hd, f = c["hidden_size"], c["head_dim"], c["moe_ffn_hidden_size"]
    t = {"model.embed_tokens.weight": torch.empty(c["vocab_size"], h), "model.norm.weight": torch.empty(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.empty(h)
        t[p + "post_attention_layernorm.weight"] = torch.empty(h)
        for name, rows in (("q", c["num_attention_heads"] * hd), ("k", c["num_key_value_heads"] * hd),
                           ("v", c["num_key_value_heads"] * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = torch.empty(rows, h)
        t[p + "self_attn.o_proj.weight"] = torch.empty(h, c["num_attention_heads"] * hd)
        t[p + "block_sparse_moe.primary_router.weight"] = torch.empty(c["moe_num_primary_experts"], h)
        for e in range(c["moe_num_primary_experts"]):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "up.weight"] = torch.empty(f, h)
            t[q + "gate.weight"] = torch.empty(f, h)
            t[q + "down.weight"] = torch.empty(h, f)
    return t


_ROUTERS = ("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight", "router.layer.weight",
            "primary_router.weight")
LOGIT_STD = 4.0  # logits of this std: greedy picks are not near-ties


def _redraw(fam: TinyFamily, config: Mapping[str, Any], params: Iterable[tuple[str, torch.Tensor]],
            seed: int) -> None:
    """Draws every tensor again, in place, so that activations are not degenerate. With tied embeddings the
    logits are E x: an embedding as large as the layers' outputs makes every token predict itself (greedy
    decoding repeats the last prompt token), so there the embedding is small (rms 0.1 once scaled for input)
    and the final norm restores logits of std LOGIT_STD."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    hidden = config["hidden_size"]
    # what the graph multiplies the embedding by on input, and divides the logits by
    input_scale = float(config.get("embedding_multiplier") or (hidden ** 0.5 if fam.norm_plus_one else 1.0))
    logit_div = float(config.get("logits_scaling") or 1.0)
    tied = bool(config.get("tie_word_embeddings"))
    embed_std = (0.1 if tied else 1.0) / input_scale
    final_norm = LOGIT_STD * logit_div / (embed_std * hidden ** 0.5) if tied else 1.0
    # granite scales each layer's attention and FFN outputs by residual_multiplier; undone in their weights
    out_gain = 1.0 / float(config.get("residual_multiplier") or 1.0)
    outputs = ("o_proj", "down_proj", "output_linear", "c_proj", ".down.")

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    with torch.no_grad():
        for name, t in params:
            if t.ndim == 1 and name.endswith("norm.weight"):  # every RMSNorm/LayerNorm weight of these families
                mean = final_norm if name == "model.norm.weight" else 1.0
                normal(t, 0.1 * mean, mean - 1.0 if fam.norm_plus_one else mean)
            elif name.endswith("e_score_correction_bias"):
                normal(t, 0.05)  # biases expert selection only; small, as trained ones are
            elif name.endswith("sinks"):
                normal(t, 1.0)  # gpt-oss's per-head attention sink logits
            elif t.ndim == 1 or name.endswith("_bias"):  # biases (gpt-oss's experts': [n_expert, n])
                normal(t, 0.1)
            elif "embed_tokens" in name:
                normal(t, embed_std)
            elif name == "lm_head.weight":
                normal(t, LOGIT_STD / t.shape[-1] ** 0.5)
            elif t.ndim == 3:
                # experts: nn.Linear-style (E, out, in) when named *.weight; gpt-oss's bare gate_up_proj and
                # down_proj are (E, in, out), as its forward computes x @ W
                fan_in = t.shape[-1] if name.endswith(".weight") else t.shape[1]
                normal(t, (out_gain if any(k in name for k in outputs) else 1.0) / fan_in ** 0.5)
            elif name.endswith(_ROUTERS):
                normal(t, 3.0 / t.shape[-1] ** 0.5)  # router logits of std ~3: tokens pick different experts
            elif any(k in name for k in ("q_proj", "k_proj", "qkv_proj", "kv_a_proj")):
                normal(t, 2.0 / t.shape[-1] ** 0.5)  # sharper attention than uniform
            else:
                normal(t, (out_gain if any(k in name for k in outputs) else 1.0) / t.shape[-1] ** 0.5)


def _tokenizer_files(fam: TinyFamily, d: Path) -> int:
    """hf_checkpoint's sentencepiece tokenizer.model, the family's added tokens after it (added_tokens.json and
    tokenizer_config.json's added_tokens_decoder, as Phi-3 ships them) and a tokenizer_config.json; the
    vocabulary size (padded to a multiple of 32 where tokens are added, as Phi-3's 32064)."""
    n_vocab = _tokenizer(d)
    added = {t: n_vocab + i for i, t in enumerate(fam.added_tokens)}
    tok_config: dict[str, Any] = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                                  "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}
    if added:
        (d / "added_tokens.json").write_text(json.dumps(added, indent=2))
        tok_config["added_tokens_decoder"] = {str(i): {"content": t, "lstrip": False, "normalized": False,
                                                       "rstrip": True, "single_word": False, "special": True}
                                              for t, i in added.items()}
        n_vocab = -(-(n_vocab + len(added)) // 32) * 32
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return n_vocab


def write_checkpoint(name: str, d: Path, seed: int = 0) -> Path:
    """Writes family `name`'s tiny checkpoint into directory d (created; must not exist), returns d."""
    import torch

    fam = FAMILIES[name]
    d.mkdir(parents=True)
    n_vocab = _tokenizer_files(fam, d)
    torch.manual_seed(seed)
    if fam.config_class is None:
        from safetensors.torch import save_file

        config = _smallthinker_config(fam, n_vocab)
        tensors = _smallthinker_tensors(config)
        _redraw(fam, config, sorted(tensors.items()), seed)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config, indent=2))
        return d
    from transformers import AutoModelForCausalLM

    config = _hf_config(fam, n_vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(fam, config.to_dict(), model.named_parameters(), seed)  # a tied lm_head is not listed again
    model.save_pretrained(d, safe_serialization=True)
    return d


def llama_cpp_dir() -> Path:
    """The pinned llama.cpp source as vendored in the sdist, unpatched: its converter and gguf-py."""
    from pi2_gguf.importer.hf_import import llama_cpp_source

    return llama_cpp_source()


@dataclass(frozen=True)
class Paths:
    checkpoint: Path
    gguf: dict[str, Path]  # outtype -> GGUF


def paths(name: str, out_dir: Path, outtypes: Iterable[str] = OUTTYPES, seed: int = 0) -> Paths:
    key = FAMILIES[name].key(seed)
    return Paths(out_dir / key, {t: out_dir / f"{key}.{t}.gguf" for t in outtypes})


class BuildError(RuntimeError):
    pass


def build_many(names: Iterable[str], out_dir: Path, outtypes: Iterable[str] = ("f32",), seed: int = 0,
               verbose: bool = False) -> dict[tuple[str, str], Path]:
    """GGUFs of the families in names, each in every outtype: {(name, outtype): path}. Checkpoints and GGUFs
    not yet under out_dir are written by ONE subprocess (torch, transformers and the converter imported once)."""
    out_dir = Path(out_dir)
    outtypes = tuple(outtypes)
    names = list(names)
    for t in outtypes:
        if t not in OUTTYPES:
            raise ValueError(f"outtype {t!r}: not one of {', '.join(OUTTYPES)}")
    for n in names:
        if n not in FAMILIES:
            raise ValueError(f"family {n!r}: not one of {', '.join(FAMILIES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[tuple[str, str], Path] = {}
    checkpoints: list[list[Any]] = []
    conversions: list[list[str]] = []
    for n in names:
        p = paths(n, out_dir, outtypes, seed)
        missing = [t for t in outtypes if not p.gguf[t].is_file()]
        if missing and not (p.checkpoint / "config.json").is_file():
            checkpoints.append([n, seed, str(p.checkpoint)])
        conversions += [[str(p.checkpoint), str(p.gguf[t]), t] for t in missing]
        result.update({(n, t): p.gguf[t] for t in outtypes})
    if conversions:
        _run_driver(checkpoints, conversions, verbose)
    absent = [f"{n} {t}" for (n, t), p in result.items() if not p.is_file()]
    if absent:
        raise BuildError(f"not written: {', '.join(absent)}")
    return result


def build(name: str, out_dir: Path, outtype: str = "f32", seed: int = 0, verbose: bool = False) -> Path:
    """Family `name`'s GGUF in outtype under out_dir (built unless already there)."""
    return build_many([name], out_dir, (outtype,), seed, verbose)[(name, outtype)]


def _run_driver(checkpoints: list[list[Any]], conversions: list[list[str]], verbose: bool) -> None:
    driver = _HERE / "tiny_families_convert.py"
    with tempfile.TemporaryDirectory() as tmp:
        jobs = Path(tmp) / "jobs.json"
        jobs.write_text(json.dumps({"checkpoints": checkpoints, "conversions": conversions}))
        cmd = [sys.executable, str(driver), str(llama_cpp_dir()), str(jobs)]
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
    if res.returncode != 0:
        tail = "" if verbose else "\n" + "\n".join((res.stderr or "").strip().splitlines()[-25:])
        raise BuildError(f"tiny_families_convert.py failed (exit {res.returncode}){tail}")


def write_checkpoint_atomic(name: str, d: Path, seed: int) -> None:
    """write_checkpoint under a temporary name beside d, renamed to d when complete (kept if d appeared)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", suffix=".tmp", dir=d.parent))
    try:
        write_checkpoint(name, tmp / "c", seed)
        try:
            os.rename(tmp / "c", d)
        except OSError:
            if not (d / "config.json").is_file():  # not another writer's complete checkpoint
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_summary(path: Path) -> tuple[str, Mapping[str, Any], set[str]]:
    """(general.architecture, the other scalar keys, tensor names) of a GGUF, read with gguf-py."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(str(path))
    kv: dict[str, Any] = {}
    for k, f in r.fields.items():
        if f.types and f.types[0] != GGUFValueType.ARRAY:
            kv[k] = f.contents()
    return str(kv["general.architecture"]), kv, {t.name for t in r.tensors}
