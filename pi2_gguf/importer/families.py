"""The checkpoint families `pi2-gguf import` knows, and the FFN activation each states in the GGUF.

Standard library only: the converter driver (llama_converter.py, run in llama.cpp's converter environment)
imports this file by path, as the parent process does before it starts the driver.

llama.cpp's converter registers LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM and ignores
`hidden_act` (llama.cpp's graph computes SiLU for them), and knows neither BambooForCausalLM (Bamboo,
TurboSparse-Mistral: dReLU) nor SparseLlamaForCausalLM (ProSparse: FATReLU). Each family here names the
converter class it extends (same tensors, same GGUF architecture) and how its config states the activation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """The checkpoint cannot be imported; the message names the file and the reason."""


@dataclass(frozen=True)
class Family:
    hf_arch: str        # config.json "architectures"[0]
    base_class: str     # llama.cpp converter class extended (conversion/<module>.py)
    module: str         # that converter module
    gguf_arch: str      # general.architecture of the output
    known_to_llama: bool  # the converter registers hf_arch itself (we override it to state the activation)


FAMILIES = {f.hf_arch: f for f in (
    Family("LlamaForCausalLM", "LlamaModel", "llama", "llama", True),
    Family("MistralForCausalLM", "LlamaModel", "llama", "llama", True),
    Family("Qwen2ForCausalLM", "Qwen2Model", "qwen", "qwen2", True),
    Family("BambooForCausalLM", "LlamaModel", "llama", "llama", False),
    Family("SparseLlamaForCausalLM", "LlamaModel", "llama", "llama", False),
)}

# tensors a checkpoint ships beside the model that llama.cpp has no place for: Bamboo/TurboSparse's
# activation predictors (mlp.predictor.fc1/fc2); `pi2-gguf convert --checkpoint` evaluates them
PREDICTOR_MARKER = ".mlp.predictor."


@dataclass(frozen=True)
class Stated:
    family: Family
    activation: str | None  # None: SiLU, what llama.cpp computes for these architectures anyway
    threshold: float        # FATReLU's t, else 0


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{hf_dir}: no config.json (not a Hugging Face checkpoint directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def stated_activation(config: dict, where: str = "config.json") -> Stated:
    """The family of a checkpoint and the activation its GGUF states, from its config.json."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise CheckpointError(f"{where}: no \"architectures\" list naming the model class")
    family = FAMILIES.get(archs[0])
    if family is None:
        raise CheckpointError(f"{where}: architecture {archs[0]} is not one pi2-gguf import knows "
                              f"({', '.join(FAMILIES)}); llama.cpp's own convert_hf_to_gguf.py converts the "
                              "others")
    act = config.get("hidden_act", "silu")
    if not isinstance(act, str):
        raise CheckpointError(f"{where}: hidden_act is {act!r}, not a name")
    act = act.lower()
    if family.hf_arch == "BambooForCausalLM":
        # BambooMLP: down(act(gate(x)) * act(up(x))): relu on both is dReLU
        if act != "relu":
            raise CheckpointError(f"{where}: BambooForCausalLM with hidden_act {act}: only relu (dReLU) is known")
        return Stated(family, "drelu", 0.0)
    if family.hf_arch == "SparseLlamaForCausalLM":
        if act == "fatrelu":
            t = config.get("hidden_act_param", 0.0)
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
                raise CheckpointError(f"{where}: hidden_act_param is {t!r}; FATReLU needs a finite threshold >= 0")
            return Stated(family, "fatrelu", float(t))
        if act == "relu":
            return Stated(family, "relu", 0.0)
        raise CheckpointError(f"{where}: SparseLlamaForCausalLM with hidden_act {act}: fatrelu or relu expected")
    if act == "silu":
        return Stated(family, None, 0.0)
    if act == "relu":
        return Stated(family, "relu", 0.0)
    raise CheckpointError(f"{where}: {family.hf_arch} with hidden_act {act}: llama.cpp would compute SiLU "
                          "instead; pi2-gguf import states silu or relu for this architecture")
