"""`pi2-gguf import HF_DIR -o MODEL.gguf [--outtype T]`: llama.cpp's convert_hf_to_gguf.py from the pinned
sdist (in a process of its own, with the families of families.py registered), then, for a quantized type,
llama.cpp's quantizer (llama_model_quantize of the installed llama-cpp-python). The output is written
beside its final path under a temporary name and renamed when complete; the checkpoint is only read."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointImportError, MissingExtraError
from ..paths import check_output
from . import families

# types the converter writes itself; the others are llama.cpp quantizer types (llama-quantize's names)
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZER_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
                   "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
OUTTYPES = CONVERTER_TYPES + QUANTIZER_TYPES
DEFAULT_OUTTYPE = "f16"
# what llama.cpp's converter imports beyond numpy (requirements-convert_hf_to_gguf.txt): the `import` extra
CONVERTER_MODULES = ("torch", "transformers", "sentencepiece", "safetensors", "google.protobuf")


@dataclass(frozen=True)
class Imported:
    path: Path
    stated: families.Stated
    outtype: str
    seconds: float
    predictor_layers: int  # layers whose checkpoint ships mlp.predictor.fc1/fc2 (for `convert --checkpoint`)


def check_extra() -> None:
    missing = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise MissingExtraError(f"pi2-gguf import runs llama.cpp's converter, which needs {', '.join(missing)}: "
                                "pip install 'pi2-gguf[import]' (make test installs it)")


def llama_cpp_source() -> Path:
    """llama.cpp as vendored in the pinned llama-cpp-python sdist, unpatched (its converter and gguf-py)."""
    from .. import llama_build

    try:
        with tempfile.TemporaryDirectory() as no_patches:
            root = llama_build.prepare_source(llama_build.ensure_sdist(), Path(no_patches))
    except llama_build.BuildError as e:
        raise CheckpointImportError(f"llama.cpp's converter is not available: {e}") from e
    return root / "vendor" / "llama.cpp"


def _safetensors_names(hf_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(hf_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                names += list(st.keys())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own and OS errors; name the file
            raise CheckpointImportError(f"{f}: not a readable safetensors file ({e})") from e
    return names


def _quantize(src: Path, dst: Path, outtype: str, threads: int) -> None:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{outtype.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise CheckpointImportError(f"llama.cpp's quantizer failed on {src} to {outtype} (code {rc})")


def import_checkpoint(hf_dir: str | Path, output: str | Path | None = None, outtype: str = DEFAULT_OUTTYPE,
                      threads: int | None = None, verbose: bool = False) -> Imported:
    t0 = time.time()
    hf_dir = Path(hf_dir)
    if outtype not in OUTTYPES:
        raise CheckpointImportError(f"--outtype {outtype}: not one of {', '.join(OUTTYPES)}")
    try:
        stated = families.stated_activation(families.read_config(hf_dir), str(hf_dir / "config.json"))
    except families.CheckpointError as e:
        raise CheckpointImportError(str(e)) from None
    check_extra()
    if not any(hf_dir.glob("*.safetensors")) and not any(hf_dir.glob("*.bin")):
        raise CheckpointImportError(f"{hf_dir}: no *.safetensors or *.bin weights")
    out = Path(output) if output is not None else hf_dir.parent / f"{hf_dir.name}-{outtype}.gguf"
    if out.is_dir():
        raise CheckpointImportError(f"-o {out}: is a directory; give the GGUF file to write")
    if not out.parent.is_dir():
        raise CheckpointImportError(f"-o {out}: directory {out.parent} does not exist")
    check_output(out, "-o")  # e.g. a read-only directory, before the converter runs
    pred_layers = len({n for n in _safetensors_names(hf_dir) if families.PREDICTOR_MARKER in n and n.endswith("fc1.weight")})

    llama_dir = llama_cpp_source()
    driver = Path(__file__).with_name("llama_converter.py")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    inter = tmp.with_suffix(".f.tmp")
    try:
        direct = outtype in CONVERTER_TYPES
        cmd = [sys.executable, str(driver), str(llama_dir), str(hf_dir), "--outfile", str(tmp if direct else inter),
               "--outtype", outtype if direct else "auto"]
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
        if res.returncode != 0:
            tail = "" if verbose else "\n" + "\n".join((res.stderr or "").strip().splitlines()[-15:])
            raise CheckpointImportError(f"llama.cpp's convert_hf_to_gguf.py failed on {hf_dir} "
                                        f"(exit {res.returncode}){tail}")
        if not direct:
            _quantize(inter, tmp, outtype, threads or os.cpu_count() or 1)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # mkstemp made it private; a model file is as readable as any other
        tmp.replace(out)
    finally:
        for p in (tmp, inter):
            p.unlink(missing_ok=True)
    return Imported(out, stated, outtype, time.time() - t0, pred_layers)
