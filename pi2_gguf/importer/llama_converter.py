"""Runs llama.cpp's own convert_hf_to_gguf.py (from the pinned sdist) with the families of families.py
registered: the converter class llama.cpp uses for the same tensors, plus the activation stated in the
GGUF, and Bamboo/TurboSparse's predictor tensors left out (llama.cpp's loader refuses unknown tensors).

Run as a script, in a process of its own, by importer/hf_import.py:

    python llama_converter.py LLAMA_CPP_DIR HF_DIR [convert_hf_to_gguf.py options]

It puts llama.cpp's converter and its gguf-py first on sys.path (they are newer than the gguf package
pi2-gguf itself uses), so it imports nothing of pi2_gguf but families.py, by path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _families():
    path = Path(__file__).with_name("families.py")
    spec = importlib.util.spec_from_file_location("pi2_import_families", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    llama_dir, hf_dir, rest = Path(argv[0]), Path(argv[1]), argv[2:]
    fam = _families()
    try:
        stated = fam.stated_activation(fam.read_config(hf_dir), str(hf_dir / "config.json"))
    except fam.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    sys.path[:0] = [str(llama_dir / "gguf-py"), str(llama_dir)]
    import importlib

    import conversion  # llama.cpp's model registry
    import convert_hf_to_gguf
    from conversion.base import ModelBase, ModelType

    family = stated.family
    base = getattr(importlib.import_module(f"conversion.{family.module}"), family.base_class)

    class Imported(base):  # type: ignore[misc, valid-type]  # a base class llama.cpp's converter names at run time
        """llama.cpp's converter for the family, stating the activation the checkpoint computes."""

        model_arch = base.model_arch

        def set_gguf_parameters(self) -> None:
            super().set_gguf_parameters()
            arch = self.gguf_writer.arch
            if stated.activation is not None:
                self.gguf_writer.add_string(f"{arch}.ffn_activation", stated.activation)
            if stated.activation == "fatrelu":
                self.gguf_writer.add_float32(f"{arch}.ffn_activation_threshold", stated.threshold)

        @classmethod
        def filter_tensors(cls, item):  # noqa: ANN001, ANN206
            return None if fam.PREDICTOR_MARKER in item[0] else super().filter_tensors(item)

    Imported.__name__ = f"Pi2{family.base_class}"
    ModelBase._model_classes[ModelType.TEXT][family.hf_arch] = Imported
    conversion.TEXT_MODEL_MAP[family.hf_arch] = family.module
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), *rest]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
