"""Writes tiny_families' checkpoints and converts them with llama.cpp's own convert_hf_to_gguf.py (from the
pinned sdist), many in one process so that torch and transformers are imported once.

    python tiny_families_convert.py LLAMA_CPP_DIR JOBS.json

JOBS.json: {"checkpoints": [[family, seed, dir], ...], "conversions": [[hf_dir, outfile, outtype], ...]}.
Each output is written under a temporary name beside it and renamed when complete. A failed job is reported
and the others still run; the exit status is 1 if any failed.

Modeled on pi2_gguf/importer/llama_converter.py: llama.cpp's converter and its gguf-py go first on sys.path
(they are newer than the gguf package pi2-gguf itself uses), and its main() runs as is, once a conversion.
One change, for this matrix only: every family's set_vocab writes the checkpoint's sentencepiece vocabulary
(`_set_vocab_sentencepiece`). The converter picks a vocabulary writer per family, and the GPT-2 style ones
recognize the pre-tokenizer by hashing the tokenizer, which a synthetic tokenizer cannot pass. The vocabulary
is not what these tests check; every tensor and every hparam key come from llama.cpp's converter class for
the family.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _tiny_families() -> Any:
    path = Path(__file__).with_name("tiny_families.py")
    spec = importlib.util.spec_from_file_location("tiny_families", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _patch_vocab(convert_hf_to_gguf: Any) -> None:
    """get_model_class as main() calls it, returning a subclass of the family's converter class whose
    set_vocab writes the sentencepiece vocabulary. A new subclass each call: class attributes main() or a
    converter class sets (no_mtp, Glm4Moe's _n_main_layers) stay with one conversion."""
    original = convert_hf_to_gguf.get_model_class

    def get_model_class(name: str, mmproj: bool = False) -> type:
        base = original(name, mmproj=mmproj)
        if mmproj:
            return base

        def set_vocab(self: Any) -> None:
            self._set_vocab_sentencepiece()

        # TextModel requires model_arch in each subclass's own __dict__
        return type(f"Tiny{base.__name__}", (base,), {"model_arch": base.model_arch, "set_vocab": set_vocab})

    convert_hf_to_gguf.get_model_class = get_model_class


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    llama_dir, jobs = Path(argv[0]), json.loads(Path(argv[1]).read_text())
    sys.path[:0] = [str(llama_dir / "gguf-py"), str(llama_dir)]  # before anything imports gguf
    tf = _tiny_families()
    failed: list[str] = []
    for name, seed, d in jobs.get("checkpoints", []):
        t0 = time.time()
        try:
            tf.write_checkpoint_atomic(name, Path(d), seed)
        except Exception:  # noqa: BLE001 - report the family and go on with the others
            traceback.print_exc()
            failed.append(f"checkpoint {name}")
            continue
        print(f"[tiny_families] checkpoint {name}: {time.time() - t0:.2f} s", file=sys.stderr)

    import convert_hf_to_gguf  # llama.cpp's

    _patch_vocab(convert_hf_to_gguf)
    for hf_dir, outfile, outtype in jobs.get("conversions", []):
        out = Path(outfile)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        t0 = time.time()
        sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", str(tmp), "--outtype", outtype]
        try:
            convert_hf_to_gguf.main()
            tmp.replace(out)
        except (Exception, SystemExit):  # noqa: BLE001 - main() exits on unsupported models; go on
            traceback.print_exc()
            failed.append(f"{Path(hf_dir).name} {outtype}")
            tmp.unlink(missing_ok=True)
            continue
        print(f"[tiny_families] {out.name}: {time.time() - t0:.2f} s", file=sys.stderr)
    if failed:
        print(f"[tiny_families] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
