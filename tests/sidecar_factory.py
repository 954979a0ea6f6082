"""Small synthetic pi2 sidecars for the reader tests, laid out as docs/FORMAT.md says.

build() makes the keys and tensors of a sidecar for a synthetic F16 model (its FFN weights are kept
in Sidecar.weights, so tests can check fingerprints against them); tests change Sidecar.kv or
Sidecar.tensors to break one rule, then write() it with gguf.GGUFWriter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from pi2_gguf.sidecar import format as sf

F16 = int(GGMLQuantizationType.F16)

_SCALAR = {sf.KT.U32: GGUFValueType.UINT32, sf.KT.U64: GGUFValueType.UINT64,
           sf.KT.F32: GGUFValueType.FLOAT32, sf.KT.STR: GGUFValueType.STRING}
_ARRAY = {sf.KT.U32_ARR: GGUFValueType.UINT32, sf.KT.U64_ARR: GGUFValueType.UINT64,
          sf.KT.F32_ARR: GGUFValueType.FLOAT32}


@dataclass
class Sidecar:
    kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]  # key -> (value, type, array element type)
    tensors: dict[str, np.ndarray]
    weights: list[list[np.ndarray]]  # the model's [gate, up, down] per layer, numpy shape (ne1, ne0), F16
    arch: str = sf.ARCHITECTURE
    alignment: int = sf.BUNDLE_ALIGN
    n_embd: int = 0
    n_ff: list[int] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        """Sets a key with the type sidecar_format.KEYS declares for it."""
        kt = sf.KEYS[key]
        if kt in _SCALAR:
            self.kv[key] = (value, _SCALAR[kt], None)
        else:
            self.kv[key] = ([v.item() if isinstance(v, np.generic) else v for v in value], GGUFValueType.ARRAY, _ARRAY[kt])

    def set_raw(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        self.kv[key] = (value, vtype, sub_type)

    def get(self, key: str) -> Any:
        return self.kv[key][0]


def weight_shape(matrix: int, n_embd: int, n_ff: int) -> tuple[int, int]:
    """(ne0, ne1) of ffn_gate (0), ffn_up (1), ffn_down (2) in ggml order."""
    return (n_ff, n_embd) if matrix == 2 else (n_embd, n_ff)


def build(n_embd: int = 64, n_ff: tuple[int, ...] = (96, 128), rank: tuple[int, ...] = (8, 16), seed: int = 0,
          bundle_size: list[int] | None = None, method: str = "cats", bundle_align: int = sf.BUNDLE_ALIGN,
          bundle_neurons: int = 1) -> Sidecar:
    rng = np.random.default_rng(seed)
    n_layer = len(n_ff)
    weights: list[list[np.ndarray]] = []
    tensors: dict[str, np.ndarray] = {}
    sizes: list[int] = []
    hot: list[int] = []
    fps: list[int] = []
    for il, (nf, r) in enumerate(zip(n_ff, rank)):
        gate = rng.standard_normal((nf, n_embd)).astype(np.float16)
        up = rng.standard_normal((nf, n_embd)).astype(np.float16)
        down = rng.standard_normal((n_embd, nf)).astype(np.float16)
        weights.append([gate, up, down])
        for m, w in enumerate((gate, up, down)):
            fps.append(sf.tensor_fingerprint(F16, *weight_shape(m, n_embd, nf), w))

        freq = rng.random(nf).astype(np.float32)
        order = np.argsort(-freq, kind="stable").astype(np.int32)
        cum = np.cumsum(freq[order])
        hot.append(int(np.searchsorted(cum, cum[-1] / 2) + 1))

        lay = sf.bundle_layout(F16, F16, F16, n_embd, bundle_align, bundle_neurons)
        size = lay.size
        flat = np.zeros(lay.n_bundles(nf) * size, dtype=np.uint8)
        for j, i in enumerate(order):
            at = lay.offset(j)
            flat[at:at + lay.up_offset] = gate[i].view(np.uint8)
            flat[at + lay.up_offset:at + lay.down_offset] = up[i].view(np.uint8)
            flat[at + lay.down_offset:at + lay.end] = np.ascontiguousarray(down[:, i]).view(np.uint8)
        bundles = flat.reshape(-1, size)
        if bundle_size is not None:  # a deliberately wrong size: cut or pad the bundles to it
            size = bundle_size[il]
            cut = np.zeros((bundles.shape[0], size), dtype=np.uint8)
            cut[:, :min(size, bundles.shape[1])] = bundles[:, :size]
            bundles = cut
        sizes.append(size)

        t = {
            "pi2_pred_w1": (rng.standard_normal((r, n_embd)) * 0.1).astype(np.float16),
            "pi2_pred_b1": rng.standard_normal(r).astype(np.float32),
            "pi2_pred_w2": (rng.standard_normal((nf, r)) * 0.1).astype(np.float16),
            "pi2_pred_b2": rng.standard_normal(nf).astype(np.float32),
            "pi2_freq": freq,
            "pi2_order": order,
            "pi2_bundles": bundles.view(np.int8),
        }
        for suffix, arr in t.items():
            tensors[sf.tensor_name(il, suffix)] = arr

    sc = Sidecar(kv={}, tensors=tensors, weights=weights, n_embd=n_embd, n_ff=list(n_ff))
    per_layer = lambda v: [v] * n_layer  # noqa: E731
    values: dict[str, Any] = {
        "pi2.format_version": sf.FORMAT_VERSION,
        "pi2.source.architecture": "llama",
        "pi2.source.name": "synthetic test model",
        "pi2.source.file_size": 123_456_789_012,
        "pi2.source.fingerprint": sf.model_fingerprint(fps),
        "pi2.source.tensor_fingerprints": fps,
        "pi2.n_layer": n_layer,
        "pi2.n_embd": n_embd,
        "pi2.n_ff": list(n_ff),
        "pi2.activation": "silu",
        "pi2.activation_threshold": 0.0,
        "pi2.sparsity.method": method,
        "pi2.sparsity.target": 0.5,
        "pi2.sparsity.thresholds": per_layer(0.25),
        "pi2.sparsity.density": per_layer(0.5),
        "pi2.predictor.rank": list(rank),
        "pi2.predictor.cutoff": per_layer(0.0),
        "pi2.predictor.recall_target": 0.95,
        "pi2.predictor.recall": per_layer(0.96),
        "pi2.predictor.precision": per_layer(0.7),
        "pi2.predictor.density": per_layer(0.6),
        "pi2.hot_count": hot,
        "pi2.calib.corpus": "synthetic",
        "pi2.calib.corpus_sha256": "0" * 64,
        "pi2.calib.tokens": 4096,
        "pi2.calib.heldout_tokens": 1024,
        "pi2.calib.date": "2025-01-01T00:00:00Z",
        "pi2.bundle.align": bundle_align,
        "pi2.bundle.size": sizes,
        "pi2.bundle.neurons": per_layer(bundle_neurons),
        "pi2.bundle.gate_type": per_layer(F16),
        "pi2.bundle.up_type": per_layer(F16),
        "pi2.bundle.down_type": per_layer(F16),
        "pi2.bundle.down_tolerance": per_layer(1e-3),
        "pi2.bundle.down_error": per_layer(0.0),
    }
    if method == "product":
        values["pi2.sparsity.product_thresholds"] = per_layer(0.125)
    assert values.keys() == sf.keys_of(method).keys()
    for k, v in values.items():
        sc.set(k, v)
    return sc


def write(sc: Sidecar, path: Path) -> Path:
    w = GGUFWriter(str(path), arch=sc.arch)
    w.add_custom_alignment(sc.alignment)
    for key, (value, vtype, sub_type) in sc.kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, arr in sc.tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
