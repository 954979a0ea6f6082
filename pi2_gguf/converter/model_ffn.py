"""The FFN weights of a GGUF model, read in place (memory-mapped by gguf-py's GGUFReader): raw rows,
dequantized matrices, the activation the model uses, and the fingerprint of docs/FORMAT.md."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ..errors import ModelFileError
from ..gguf_file import check_model_file
from ..runtime import ggml_base
from ..sidecar import format as fmt

MATRICES = ("gate", "up", "down")

# FFN activation of architectures whose llama.cpp graph builds it whatever the file states (src/models/*.cpp:
# smallthinker's experts are ReGLU, gemma's FFN GEGLU); the plugin's table is the same (activation.h,
# pi2_arch_activations; tests/test_architectures.py checks they agree). Any other model may state its activation in
# "<arch>.ffn_activation" (and FATReLU's threshold in "<arch>.ffn_activation_threshold"), which the PI2 plugin
# computes on any llama.cpp and the patch in patches/ makes llama.cpp itself compute; one that states none
# runs SwiGLU.
ARCH_ACTIVATION = {"smallthinker": "relu", "gemma": "gelu", "gemma2": "gelu", "gemma3": "gelu", "gemma3n": "gelu",
                   "gemma4": "gelu", "gemma-embedding": "gelu", "gpt-oss": "swiglu_oai"}
# gpt-oss's SwiGLU-OAI: min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1), with the constants
# llama.cpp's build_moe_ffn fixes (LLM_FFN_SWIGLU_OAI_MOE) and hands the GLU node, from which the plugin reads them
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = np.float32(1.702), np.float32(7.0)
ACTIVATION_KEY = "{arch}.ffn_activation"
ACTIVATION_THRESHOLD_KEY = "{arch}.ffn_activation_threshold"
# names a model may state, as the plugin reads them ("reglu" is relu)
STATED_ACTIVATIONS = {**{a: a for a in fmt.ACTIVATIONS}, "reglu": "relu"}


@dataclass(frozen=True)
class FfnTensor:
    name: str
    qtype: GGMLQuantizationType
    ne0: int
    ne1: int
    data: np.ndarray  # raw bytes [ne1, row bytes] (uint8), or [ne1, ne0] for float types

    @property
    def raw(self) -> np.ndarray:
        """[ne1, row bytes] uint8 view of the tensor's data."""
        return self.data.view(np.uint8).reshape(self.ne1, -1)

    def dequantized(self) -> np.ndarray:
        """[ne1, ne0] float32."""
        return ggml_base.to_float(int(self.qtype), self.data, self.ne0 * self.ne1).reshape(self.ne1, self.ne0)

    def fingerprint(self) -> int:
        return fmt.tensor_fingerprint(int(self.qtype), self.ne0, self.ne1, self.data)


def _string(reader: GGUFReader, key: str, path: Path) -> str | None:
    f = reader.get_field(key)
    try:
        return None if f is None else str(f.contents())
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: key {key} is not UTF-8 text ({e.reason} at byte {e.start})") from e


class ModelFfn:
    def __init__(self, path: str | Path) -> None:
        self.path = check_model_file(path)
        self.file_size = self.path.stat().st_size
        self.reader = GGUFReader(self.path, "r")
        arch = _string(self.reader, "general.architecture", self.path)
        if arch is None:
            raise ModelFileError(f"{self.path} has no general.architecture")
        self.architecture = arch
        self.name = _string(self.reader, "general.name", self.path) or ""
        tensors = {t.name: t for t in self.reader.tensors}
        why = layout_refusal(arch, tensors)
        if why is not None:
            raise ModelFileError(f"{self.path}: {why}")
        self.layers: list[dict[str, FfnTensor]] = []
        # routed experts (MoE): each (layer, expert) is one of the sidecar's layers, a layer's shared expert one
        # more after them, and so is a dense FFN layer among them (the DeepSeek-V2 / GLM-4.5 layout), in model-layer
        # order (FORMAT.md, "MoE sidecars"); layer_experts: per model layer 0 (dense FFN), n_expert, or n_expert + 1
        # (and a shared expert). n_expert 0: a dense model
        self.n_expert = 0
        self.moe_layers = 0
        # gpt-oss: each routed expert's gate and up biases (added to its products before the activation), by layer
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.layer_experts: list[int] = []
        il = 0
        while True:
            if f"blk.{il}.ffn_gate_exps.weight" in tensors or f"blk.{il}.ffn_gate_up_exps.weight" in tensors:
                self._read_experts(tensors, il)
                shared = f"blk.{il}.ffn_gate_shexp.weight" in tensors
                if shared:
                    self.layers.append(self._read_dense(tensors, il, "_shexp"))
                self.layer_experts.append(self.n_expert + shared)
                self.moe_layers += 1
            elif f"blk.{il}.ffn_gate.weight" in tensors or _fused_gate_up(tensors, il):
                self.layers.append(self._read_dense(tensors, il))
                self.layer_experts.append(0)
            else:
                break
            il += 1
        if not self.layers:
            raise ModelFileError(f"{self.path} has no gated FFN layers (blk.N.ffn_gate/up/down.weight, or routed "
                                 "experts blk.N.ffn_gate/up/down_exps.weight)")
        self.n_embd = self.layers[0]["gate"].ne0
        if any(l_["gate"].ne0 != self.n_embd for l_ in self.layers):
            raise ModelFileError(f"{self.path}: FFN layers differ in input width")
        self.activation, self.activation_threshold = self._activation()
        # an output matrix of its own (not tied to the token embedding): under a memory budget the plugin can
        # leave it in the file and read a token's top rows (PI2_OUTPUT_ROWS)
        self.has_output = "output.weight" in tensors
        # the bytes of the matrix the output layer multiplies by: its own, else the tied token embedding
        table = tensors.get("output.weight" if self.has_output else "token_embd.weight")
        self.output_bytes = int(table.n_bytes) if table is not None else 0

    def _check_shapes(self, layer: dict[str, FfnTensor], what: str) -> None:
        g, u, d = layer["gate"], layer["up"], layer["down"]
        if not (g.ne0 == u.ne0 == d.ne1 and g.ne1 == u.ne1 == d.ne0):
            raise ModelFileError(f"{self.path}: {what} shapes disagree: gate {g.ne0}x{g.ne1}, "
                                 f"up {u.ne0}x{u.ne1}, down {d.ne0}x{d.ne1}")

    def _weight(self, tensors: dict, name: str, first: str, dims: int) -> tuple[str, GGMLQuantizationType, list[int], Any]:
        """(name, type, ne, data) of FFN weight `name`, which `first` (the layer's gate) implies; ModelFileError unless
        it is there with `dims` dimensions (3: one matrix per expert)."""
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path} has {first} but no {name}")
        ne = [int(x) for x in t.shape]
        if len(ne) != dims:
            raise ModelFileError(f"{name} in {self.path} has {len(ne)} dimensions, expected {dims}"
                                 + (" (one matrix per expert)" if dims == 3 else ""))
        return name, GGMLQuantizationType(int(t.tensor_type)), ne, t.data

    def _read_dense(self, tensors: dict, il: int, kind: str = "") -> dict[str, FfnTensor]:
        """Layer il's dense FFN, or with kind "_shexp" the shared expert beside its routed ones. A fused gate+up
        (phi3's ffn_up: the gate's rows, then the up's) is read as its two halves, each fingerprinted as a tensor of
        its own (FORMAT.md, "Fingerprint")."""
        layer: dict[str, FfnTensor] = {}
        if not kind and _fused_gate_up(tensors, il):
            t = tensors[f"blk.{il}.ffn_up.weight"]
            ne0, ne1 = (int(x) for x in t.shape)
            qt, half = GGMLQuantizationType(int(t.tensor_type)), ne1 // 2
            layer["gate"] = FfnTensor(t.name, qt, ne0, half, t.data[:half])
            layer["up"] = FfnTensor(t.name, qt, ne0, half, t.data[half:])
            d = tensors[f"blk.{il}.ffn_down.weight"]
            dne0, dne1 = (int(x) for x in d.shape)
            layer["down"] = FfnTensor(d.name, GGMLQuantizationType(int(d.tensor_type)), dne0, dne1, d.data)
            self._check_shapes(layer, f"layer {il} FFN")
            return layer
        for m in MATRICES:
            name, qt, ne, data = self._weight(tensors, f"blk.{il}.ffn_{m}{kind}.weight", f"blk.{il}.ffn_gate{kind}.weight", 2)
            layer[m] = FfnTensor(name, qt, ne[0], ne[1], data)
        self._check_shapes(layer, f"layer {il} {'shared expert' if kind else 'FFN'}")
        return layer

    def _read_experts(self, tensors: dict, il: int) -> None:
        """One layer per expert of model layer il, its matrices the expert's slices of the stacked *_exps tensors."""
        stacked: dict[str, tuple] = {}
        fused = tensors.get(f"blk.{il}.ffn_gate_up_exps.weight")
        if fused is not None and f"blk.{il}.ffn_gate_exps.weight" not in tensors:
            # --fuse-gate-up-exps: each expert's gate rows, then its up rows, read as its gate and up
            ne = [int(x) for x in fused.shape]
            if len(ne) != 3 or ne[1] % 2:
                raise ModelFileError(f"{fused.name} in {self.path} is not [n_embd, 2 n_ff, n_expert]")
            half = ne[1] // 2
            qt = GGMLQuantizationType(int(fused.tensor_type))
            stacked["gate"] = (fused.name, qt, [ne[0], half, ne[2]], fused.data[:, :half])
            stacked["up"] = (fused.name, qt, [ne[0], half, ne[2]], fused.data[:, half:])
        for m in MATRICES:
            if m in stacked:
                continue
            stacked[m] = self._weight(tensors, f"blk.{il}.ffn_{m}_exps.weight", f"blk.{il}.ffn_gate_exps.weight", 3)
        n_expert = stacked["gate"][2][2]
        if self.n_expert not in (0, n_expert) or any(v[2][2] != n_expert for v in stacked.values()):
            raise ModelFileError(f"{self.path}: layer {il}'s experts disagree in number")
        self.n_expert = n_expert
        n_ff = stacked["gate"][2][1]
        biases = [self._expert_bias(tensors, f"blk.{il}.ffn_{m}_exps.bias", n_ff, n_expert) for m in ("gate", "up")]
        for e in range(n_expert):
            layer = {m: FfnTensor(name, qt, ne[0], ne[1], data[e]) for m, (name, qt, ne, data) in stacked.items()}
            self._check_shapes(layer, f"layer {il} expert FFN")
            if biases[0] is not None or biases[1] is not None:
                gate_b, up_b = (np.zeros(n_ff, np.float32) if b is None else b[e] for b in biases)
                self.biases[len(self.layers)] = (gate_b, up_b)
            self.layers.append(layer)

    def _expert_bias(self, tensors: dict, name: str, n_ff: int, n_expert: int) -> np.ndarray | None:
        """An f32 expert bias [n_expert, n_ff] (gpt-oss's ffn_{gate,up}_exps.bias), or None where the model has none."""
        t = tensors.get(name)
        if t is None:
            return None
        if int(t.tensor_type) != int(GGMLQuantizationType.F32) or [int(x) for x in t.shape] != [n_ff, n_expert]:
            raise ModelFileError(f"{name} in {self.path} is not an f32 [{n_ff}, {n_expert}] bias of the layer's experts")
        return np.asarray(t.data, dtype=np.float32).reshape(n_expert, n_ff)

    def gate_values(self, layer: int, gate_w: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Sidecar layer `layer`'s gate values for inputs x [n_tokens, n_embd]: x gate^T (gate_w dequantized), plus
        the expert's gate bias where it has one."""
        g = np.asarray(x, dtype=np.float32) @ gate_w.T
        return g + self.biases[layer][0] if layer in self.biases else g

    def up_values(self, layer: int, up_w: np.ndarray, x: np.ndarray) -> np.ndarray:
        """act_up of sidecar layer `layer`'s up values for inputs x: x up^T plus its up bias, through act_up."""
        u = np.asarray(x, dtype=np.float32) @ up_w.T
        return up_values(self.activation, u + self.biases[layer][1] if layer in self.biases else u)

    @property
    def mixed(self) -> bool:
        """An MoE model whose layers are not all routed experts alone: dense FFN layers among them, or shared experts
        (pi2.moe.layer_experts says which layer is which)."""
        return bool(self.n_expert) and any(c != self.n_expert for c in self.layer_experts)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def n_ff(self, layer: int) -> int:
        return self.layers[layer]["gate"].ne1

    def _activation(self) -> tuple[str, float]:
        key = ACTIVATION_KEY.format(arch=self.architecture)
        tkey = ACTIVATION_THRESHOLD_KEY.format(arch=self.architecture)
        stated = _string(self.reader, key, self.path)
        f = self.reader.get_field(tkey)
        threshold = 0.0 if f is None else float(f.contents())
        if stated is None and f is not None:
            raise ModelFileError(f"{self.path} has {tkey} but no {key}")
        built = ARCH_ACTIVATION.get(self.architecture)
        if built is not None:
            # llama.cpp computes what the graph builds: a sidecar is made for that, never for the statement
            if stated is not None and (STATED_ACTIVATIONS.get(stated) != built or threshold != 0.0):
                warnings.warn(f"{self.path} states {key} = '{stated}', but llama.cpp's {self.architecture} graph "
                              f"computes {built} whatever it states; the sidecar is made for {built}", stacklevel=2)
            return built, 0.0
        if stated is None:
            return "silu", 0.0
        if stated not in STATED_ACTIVATIONS:
            raise ModelFileError(f"{self.path} states FFN activation {key} = '{stated}'; pi2 computes "
                                 f"{', '.join(STATED_ACTIVATIONS)}")
        stated = STATED_ACTIVATIONS[stated]
        if stated == "fatrelu" and not (np.isfinite(threshold) and threshold >= 0):
            raise ModelFileError(f"{self.path}: {tkey} is {threshold}: fatrelu needs a finite threshold >= 0")
        if stated != "fatrelu" and threshold != 0.0:
            raise ModelFileError(f"{self.path}: {tkey} is {threshold}, but {stated} has no threshold")
        return stated, threshold

    def act(self, g: np.ndarray) -> np.ndarray:
        """act_gate(g) of this model's activation."""
        return activation_values(self.activation, g, self.activation_threshold)

    def tensor_fingerprints(self) -> list[int]:
        ts = [self.layers[il][m] for il in range(self.n_layer) for m in MATRICES]
        return fmt.tensor_fingerprints([(int(t.qtype), t.ne0, t.ne1, t.data) for t in ts])

    def fingerprint(self) -> int:
        return fmt.model_fingerprint(self.tensor_fingerprints())


def layout_refusal(arch: str, tensors: Mapping[str, Any]) -> str | None:
    """Why a sidecar cannot describe this FFN layout, naming its first layer (docs/ARCHITECTURES.md), or None.
    tensors: the model's tensors by name (gguf-py's, with .shape). llama.cpp computes these models right
    without a sidecar: PI2 computes their products densely or leaves them to ggml-cpu."""
    def layers(suffix: str) -> list[int]:
        return sorted(int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.endswith(suffix))

    dense, routed = layers(".ffn_gate.weight"), layers(".ffn_gate_exps.weight") + layers(".ffn_gate_up_exps.weight")
    ungated = [il for il in layers(".ffn_up.weight") if il not in dense and not _fused_gate_up(tensors, il)]
    if ungated and not routed:
        return (f"blk.{ungated[0]}'s FFN has no gate ({arch}: up, activation, down), and PowerInfer-2's sparse decode "
                "predicts a gated FFN's neurons; convert cannot make a sidecar")
    return None


def _fused_gate_up(tensors: Mapping[str, Any], il: int) -> bool:
    """Layer il's ffn_up holds gate and up fused (phi3: 2 n_ff rows, the gate's first) and it has no ffn_gate."""
    up, down = tensors.get(f"blk.{il}.ffn_up.weight"), tensors.get(f"blk.{il}.ffn_down.weight")
    return (f"blk.{il}.ffn_gate.weight" not in tensors and up is not None and down is not None and len(up.shape) == 2
            and int(up.shape[1]) == 2 * int(down.shape[0]))


def gguf_layout_refusal(path: Path) -> str | None:
    """layout_refusal of a GGUF file (read with gguf-py; the caller has checked the file)."""
    reader = GGUFReader(path, "r")
    arch = _string(reader, "general.architecture", path) or "?"
    return layout_refusal(arch, {t.name: t for t in reader.tensors})


def activation_values(kind: str, g: np.ndarray, threshold: float = 0.0) -> np.ndarray:
    """act_gate(g) elementwise (float32) for the gate pre-activations g (threshold: FATReLU's t)."""
    g = np.asarray(g, dtype=np.float32)
    if kind == "fatrelu":
        return np.where(g > threshold, g, 0.0).astype(np.float32)
    if kind == "silu":  # g / (1 + exp(-g)) in one buffer: the same values, a third less time on a profile's 55M
        t = np.negative(g)
        np.exp(t, out=t)
        t += np.float32(1.0)
        return np.divide(g, t, out=t)
    if kind == "gelu":  # tanh approximation, as ggml_gelu
        return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    if kind == "gelu_erf":
        from math import erf, sqrt

        return (0.5 * g * (1.0 + np.vectorize(erf, otypes=[np.float32])(g / sqrt(2.0)))).astype(np.float32)
    if kind in fmt.RELU_FAMILY:
        return np.maximum(g, 0.0)
    if kind == "swiglu_oai":  # as ggml-cpu: x = min(g, limit); x / (1 + exp(-alpha x))
        x = np.minimum(g, SWIGLU_OAI_LIMIT)
        return (x / (np.float32(1.0) + np.exp(SWIGLU_OAI_ALPHA * -x))).astype(np.float32)
    raise ValueError(f"unknown activation {kind}")


def up_values(kind: str, u: np.ndarray) -> np.ndarray:
    """act_up(u): relu(u) for dReLU, clamp(u, -limit, limit) + 1 for SwiGLU-OAI, u itself for the others."""
    u = np.asarray(u, dtype=np.float32)
    if kind == "swiglu_oai":
        return np.clip(u, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + np.float32(1.0)
    return np.maximum(u, 0.0) if kind == "drelu" else u
