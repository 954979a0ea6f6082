"""Every pi2-gguf command with bad input: the inputs (made in a directory of their own) and the cases, shared by
tests/test_cli_errors.py and tools/cli_bad_input_table.py. Each case must end in exit code 2 and one line on
stderr naming the problem, never a traceback, and before any heavy work.

Commands run with that directory as their working directory and relative paths, so that the messages read as a
user would see them. Unreadable files and read-only directories: the tests run as root, whom mode bits do not
stop, so those cases run the command without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (dropped from the bounding
set before exec: root then gets the permissions of the file's owner bits, like any user)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CLI = [sys.executable, "-m", "pi2_gguf.cli"]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


@dataclass(frozen=True)
class Case:
    command: str
    what: str                 # the bad input, in words
    args: tuple[str, ...]     # after the command; {name} are Inputs' names
    expect: str               # the error line contains this ({name} too)
    unprivileged: bool = False  # run without root's DAC override (unreadable file, read-only directory)
    env: dict[str, str] = field(default_factory=dict)
    needs: str = ""           # a module the case needs (skipped without it)

    @property
    def id(self) -> str:
        return f"{self.command}-" + re.sub(r"[^a-z0-9]+", "-", self.what.lower()).strip("-")


def _link(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def _write_gguf(path: Path, arch: str) -> Path:
    """A valid GGUF with one tensor that is no model llama.cpp knows."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Inputs:
    """The bad (and the few good) inputs in directory d: models hard-linked (never written to), everything
    else small files made here. names maps {name} to a path relative to d or a value."""

    def __init__(self, d: Path, smol: Path, gemma: Path, smol_sidecar: Path) -> None:
        self.dir = d
        d.mkdir(parents=True, exist_ok=True)
        _link(smol, d / "smol.gguf")
        _link(gemma, d / "gemma.gguf")
        _link(smol_sidecar, d / "sidecars" / "smol.pi2.gguf")  # not beside smol.gguf: no default sidecar
        (d / "adir").mkdir(exist_ok=True)
        if not (d / "fifo.gguf").exists():
            os.mkfifo(d / "fifo.gguf")
        unreadable = d / "unreadable.gguf"
        unreadable.write_bytes(b"GGUF\x03\x00\x00\x00")
        unreadable.chmod(0)
        (d / "notes.gguf").write_text("not a model\n")
        with smol.open("rb") as f:
            (d / "truncated.gguf").write_bytes(f.read(8 << 20))
        with smol_sidecar.open("rb") as f:
            (d / "sidecars" / "truncated.pi2.gguf").write_bytes(f.read(1 << 20))
        if not (d / "dangling.gguf").is_symlink():
            os.symlink("nowhere.gguf", d / "dangling.gguf")
        _write_gguf(d / "foreign.gguf", "nosuch")
        ro = d / "readonly"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        (d / "short.txt").write_text("Only a few words here.\n")
        (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
        (d / "empty.txt").write_text("\n\n")
        for name in ("hf-empty", "hf-badjson", "hf-unknown", "hf-ok"):
            (d / name).mkdir(exist_ok=True)
        (d / "hf-badjson" / "config.json").write_text("{not json")
        (d / "hf-unknown" / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
        (d / "hf-ok" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_act": "relu"}')
        (d / "hf-ok" / "model.safetensors").write_bytes(b"")  # reached only after -o is checked
        self._busy = socket.socket()
        self._busy.bind(("127.0.0.1", 0))
        self._busy.listen()
        self.names = {
            "smol": "smol.gguf", "gemma": "gemma.gguf", "sidecar": "sidecars/smol.pi2.gguf",
            "truncated_sidecar": "sidecars/truncated.pi2.gguf", "missing": "missing.gguf", "dir": "adir",
            "fifo": "fifo.gguf", "unreadable": "unreadable.gguf", "notgguf": "notes.gguf",
            "truncated": "truncated.gguf", "dangling": "dangling.gguf", "foreign": "foreign.gguf",
            "readonly": "readonly", "nodir": "no-such-dir", "short_text": "short.txt", "latin1": "latin1.txt",
            "empty_text": "empty.txt", "port": str(_free_port()), "busy_port": str(self._busy.getsockname()[1]),
        }

    def close(self) -> None:
        self._busy.close()
        (self.dir / "readonly").chmod(0o755)
        (self.dir / "unreadable.gguf").chmod(0o644)

    def format(self, text: str) -> str:
        return text.format(**self.names)


def _drop_dac_override() -> None:
    """In the child before exec: root without DAC override is refused by mode bits (the owner's bits apply)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def unprivileged_works(d: Path) -> bool:
    """Whether a command run for an `unprivileged` case is refused an unreadable file (root without
    CAP_SETPCAP cannot drop the capabilities)."""
    code = f"open({str(d / 'unreadable.gguf')!r}, 'rb')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         preexec_fn=_drop_dac_override if os.geteuid() == 0 else None)
    return res.returncode != 0


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_case(case: Case, inputs: Inputs, timeout: float = 120) -> Result:
    args = [inputs.format(a) for a in case.args]
    env = {**os.environ, **case.env}
    try:
        res = subprocess.run([*CLI, case.command, *args], cwd=inputs.dir, env=env, capture_output=True, text=True,
                             timeout=timeout,
                             preexec_fn=_drop_dac_override if case.unprivileged and os.geteuid() == 0 else None)
    except subprocess.TimeoutExpired as e:
        out = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Result(["pi2-gguf", case.command, *args], -1, "", out + f"\n(timed out after {timeout} s)")
    return Result(["pi2-gguf", case.command, *args], res.returncode, res.stdout, res.stderr)


S, B = "{smol}", "{sidecar}"  # the model and its sidecar, for cases whose bad input is elsewhere

CASES: list[Case] = [
    # --- run ---
    Case("run", "missing model file", ("{missing}",), "model file not found: {missing}"),
    Case("run", "directory as model", ("{dir}",), "{dir}"),
    Case("run", "FIFO as model", ("{fifo}",), "not a file: {fifo}"),
    Case("run", "unreadable model", ("{unreadable}",), "cannot read model file {unreadable}: Permission denied",
         unprivileged=True),
    Case("run", "not a GGUF file", ("{notgguf}",), "{notgguf} is not a GGUF file"),
    Case("run", "truncated GGUF", ("{truncated}",), "{truncated}: is truncated"),
    Case("run", "dangling symlink as model", ("{dangling}",), "{dangling} is a symbolic link to nowhere.gguf"),
    Case("run", "sidecar given as model", ("{sidecar}",), "{sidecar} is a pi2 sidecar, not a model"),
    Case("run", "GGUF of an unknown architecture", ("{foreign}",), "architecture 'nosuch'"),
    Case("run", "unknown architecture without plugin", ("{foreign}", "--no-plugin"), "architecture 'nosuch'"),
    Case("run", "SmolLM2 sidecar for Gemma-3", ("{gemma}", "--sidecar", B), "was made for another model"),
    Case("run", "truncated sidecar", (S, "--sidecar", "{truncated_sidecar}"), "{truncated_sidecar}: is truncated"),
    Case("run", "missing sidecar", (S, "--sidecar", "{missing}"), "sidecar {missing}"),
    Case("run", "FIFO as sidecar", (S, "--sidecar", "{fifo}"), "sidecar {fifo}: is not a regular file"),
    Case("run", "model as sidecar", (S, "--sidecar", "{gemma}"), "is not a pi2 sidecar"),
    Case("run", "negative -n", (S, "-n", "-1"), "argument -n/--n-predict: -1 is out of range"),
    Case("run", "zero -n", (S, "-n", "0"), "argument -n/--n-predict: 0 is out of range"),
    Case("run", "non-integer -n", (S, "-n", "12XB"), "argument -n/--n-predict: '12XB' is not an integer"),
    Case("run", "huge -n", (S, "-n", "1000000000000"), "argument -n/--n-predict: 1000000000000 is out of range"),
    Case("run", "-n beyond the context", (S, "-n", "3000"), "-n 3000"),
    Case("run", "zero --threads", (S, "-t", "0"), "argument -t/--threads: 0 is out of range"),
    Case("run", "huge --threads", (S, "-t", "100000"), "argument -t/--threads: 100000 is out of range"),
    Case("run", "zero --ctx", (S, "-c", "0"), "argument -c/--ctx: 0 is out of range"),
    Case("run", "NaN --ctx", (S, "-c", "nan"), "argument -c/--ctx: 'nan' is not an integer"),
    Case("run", "--ctx past the training context", (S, "-c", "100000000"), "-c/--ctx 100000000: more than the 8192"),
    Case("run", "--ctx past 32 bits", (S, "-c", "4294967312"), "argument -c/--ctx: 4294967312 is out of range"),
    Case("run", "negative --seed", (S, "--seed", "-1"), "argument --seed: -1 is out of range"),
    Case("run", "unknown --mode", (S, "--mode", "fast"), "argument --mode: invalid choice: 'fast'"),
    Case("run", "malformed --memory-budget", (S, "--sidecar", B, "--memory-budget", "12XB"), "'12XB' is not a size"),
    Case("run", "negative --memory-budget", (S, "--sidecar", B, "--memory-budget=-5MB"), "'-5MB' is not a size"),
    Case("run", "zero --memory-budget", (S, "--sidecar", B, "--memory-budget", "0"), "'0' is not a positive size"),
    Case("run", "NaN --memory-budget", (S, "--sidecar", B, "--memory-budget", "nan"), "'nan' is not a size"),
    Case("run", "too large --memory-budget", (S, "--sidecar", B, "--memory-budget", "1e30GB"),
         "'1e30GB' is not a size"),
    Case("run", "too small --memory-budget", (S, "--sidecar", B, "--memory-budget", "1MB"),
         "is too small for smol.gguf"),
    Case("run", "--memory-budget without sidecar", (S, "--memory-budget", "300MB"), "needs the model's sidecar"),
    Case("run", "--memory-budget with --no-plugin", (S, "--no-plugin", "--memory-budget", "300MB"),
         "needs the PI2 plugin"),
    Case("run", "sparse mode without sidecar", (S, "--mode", "oracle"), "mode oracle needs a sidecar"),
    # --- demo (each refused before it would convert the model) ---
    Case("demo", "missing model file", ("{missing}",), "model file not found: {missing}"),
    Case("demo", "directory as model", ("{dir}",), "{dir}"),
    Case("demo", "truncated GGUF", ("{truncated}",), "{truncated}: is truncated"),
    Case("demo", "sidecar given as model", ("{sidecar}",), "is a pi2 sidecar, not a model"),
    Case("demo", "GGUF of an unknown architecture", ("{foreign}",), "architecture 'nosuch'"),
    Case("demo", "malformed --memory-limit", (S, "--memory-limit", "12XB"), "--memory-limit '12XB' is not a size"),
    Case("demo", "zero --memory-limit (as --memory-budget)", (S, "--memory-budget", "0"),
         "--memory-limit '0' is not a positive size"),
    Case("demo", "zero -n", (S, "-n", "0"), "argument -n/--n-predict: 0 is out of range"),
    Case("demo", "-n beyond the context", (S, "-n", "600"), "-n 600: the prompt's"),
    Case("demo", "--ctx past the training context", ("{gemma}", "-c", "40000"), "-c/--ctx 40000: more than the 32768"),
    Case("demo", "zero --threads", (S, "-t", "0"), "argument -t/--threads: 0 is out of range"),
    # --- models, backend-path ---
    Case("models", "unknown model name", ("llama-7b",), "unknown model 'llama-7b'"),
    Case("backend-path", "PI2_PLUGIN naming a missing file", (), "PI2_PLUGIN={missing} is not a file",
         env={"PI2_PLUGIN": "missing.gguf"}),
    Case("backend-path", "an extra argument", ("extra",), "unrecognized arguments: extra"),
    # --- serve (each refused before it listens) ---
    Case("serve", "missing model file", ("{missing}", "--port", "{port}"), "model file not found: {missing}"),
    Case("serve", "sidecar given as model", ("{sidecar}", "--port", "{port}"), "is a pi2 sidecar, not a model"),
    Case("serve", "GGUF of an unknown architecture", ("{foreign}", "--port", "{port}"), "architecture 'nosuch'"),
    Case("serve", "SmolLM2 sidecar for Gemma-3", ("{gemma}", "--sidecar", B, "--port", "{port}"),
         "was made for another model"),
    Case("serve", "malformed --memory-budget", (S, "--sidecar", B, "--memory-budget", "12XB", "--port", "{port}"),
         "--memory-budget '12XB' is not a size"),
    Case("serve", "too small --memory-budget", (S, "--sidecar", B, "--memory-budget", "1MB", "--port", "{port}"),
         "is too small for smol.gguf"),
    Case("serve", "out-of-range --port", (S, "--port", "70000"), "argument --port: 70000 is not a TCP port"),
    Case("serve", "non-integer --port", (S, "--port", "http"), "argument --port: http is not a TCP port"),
    Case("serve", "port in use", (S, "--port", "{busy_port}"), "cannot listen on 127.0.0.1:{busy_port}"),
    Case("serve", "unresolvable --host", (S, "--host", "no-such-host.invalid", "--port", "{port}"),
         "--host no-such-host.invalid: cannot be resolved"),
    Case("serve", "zero --n-ctx", (S, "--n-ctx", "0"), "argument --n-ctx: 0 is out of range"),
    Case("serve", "--n-ctx past the training context", (S, "--n-ctx", "9000", "--port", "{port}"),
         "--n-ctx 9000: more than the 8192"),
    Case("serve", "zero --threads", (S, "-t", "0"), "argument -t/--threads: 0 is out of range"),
    # --- import ---
    Case("import", "missing checkpoint directory", ("no-such-checkpoint",), "no-such-checkpoint: not a directory"),
    Case("import", "a file instead of a directory", ("{smol}",), "{smol}: not a directory"),
    Case("import", "directory without config.json", ("hf-empty",), "hf-empty: no config.json"),
    Case("import", "config.json not JSON", ("hf-badjson",), "hf-badjson/config.json: cannot be read as JSON"),
    Case("import", "unknown architecture", ("hf-unknown",), "architecture FooForCausalLM is not one"),
    Case("import", "-o in a missing directory", ("hf-ok", "-o", "{nodir}/m.gguf"),
         "-o {nodir}/m.gguf: directory {nodir} does not exist", needs="torch"),
    Case("import", "-o a directory", ("hf-ok", "-o", "{dir}"), "-o {dir}: is a directory", needs="torch"),
    Case("import", "-o in a read-only directory", ("hf-ok", "-o", "{readonly}/m.gguf"),
         "cannot create files in {readonly}: Permission denied", unprivileged=True, needs="torch"),
    Case("import", "-o where no file can be made", ("hf-ok", "-o", "/proc/m.gguf"), "-o /proc/m.gguf: cannot create",
         needs="torch"),
    Case("import", "unknown --outtype", ("hf-ok", "--outtype", "q3"), "argument --outtype: invalid choice: 'q3'"),
    Case("import", "zero --threads", ("hf-ok", "-t", "0"), "argument -t/--threads: 0 is out of range"),
    # --- profile ---
    Case("profile", "missing model file", ("{missing}",), "model file not found: {missing}"),
    Case("profile", "sidecar given as model", ("{sidecar}",), "is a pi2 sidecar, not a model"),
    Case("profile", "GGUF of an unknown architecture", ("{foreign}", "--text", "{short_text}"),
         "architecture 'nosuch'"),
    Case("profile", "-o in a missing directory", (S, "-o", "{nodir}/p.npz"), "-o {nodir}/p.npz: directory {nodir}"),
    Case("profile", "-o in a read-only directory", (S, "-o", "{readonly}/p.npz"),
         "cannot create files in {readonly}: Permission denied", unprivileged=True),
    Case("profile", "missing --text", (S, "--text", "{missing}"), "text file not found: {missing}"),
    Case("profile", "directory as --text", (S, "--text", "{dir}"), "text file {dir} is not a regular file"),
    Case("profile", "FIFO as --text", (S, "--text", "{fifo}"), "text file {fifo} is not a regular file"),
    Case("profile", "unreadable --text", (S, "--text", "{unreadable}"), "cannot read text file {unreadable}",
         unprivileged=True),
    Case("profile", "--text not UTF-8", (S, "--text", "{latin1}"), "{latin1} is not UTF-8 text"),
    Case("profile", "empty --text", (S, "--text", "{empty_text}"), "{empty_text} holds no text"),
    Case("profile", "too few --train-tokens", (S, "--train-tokens", "10"),
         "argument --train-tokens: 10 is out of range"),
    Case("profile", "huge --train-tokens", (S, "--text", "{short_text}", "--train-tokens", "2000000000"),
         "--train-tokens 2000000000 + --heldout-tokens"),
    Case("profile", "negative --heldout-tokens", (S, "--heldout-tokens", "-1"), "argument --heldout-tokens: -1 is out"),
    Case("profile", "zero --window", (S, "--window", "0"), "argument --window: 0 is out of range"),
    Case("profile", "--window past the training context", (S, "--window", "100000"),
         "--window 100000: more than the 8192"),
    Case("profile", "--text too short to profile", (S, "--text", "{short_text}"), "the corpus short.txt gives only"),
    # --- convert (each refused before it profiles) ---
    Case("convert", "missing model file", ("{missing}",), "model file not found: {missing}"),
    Case("convert", "FIFO as model", ("{fifo}",), "not a file: {fifo}"),
    Case("convert", "unreadable model", ("{unreadable}",), "cannot read model file {unreadable}", unprivileged=True),
    Case("convert", "truncated GGUF", ("{truncated}",), "{truncated}: is truncated"),
    Case("convert", "dangling symlink as model", ("{dangling}",), "{dangling} is a symbolic link"),
    Case("convert", "sidecar given as model", ("{sidecar}",), "is a pi2 sidecar, not a model"),
    Case("convert", "GGUF without FFN layers", ("{foreign}",), "has no gated FFN layers"),
    Case("convert", "-o in a missing directory", (S, "-o", "{nodir}/s.pi2.gguf"),
         "{nodir}/s.pi2.gguf: directory {nodir}"),
    Case("convert", "-o a directory", (S, "-o", "{dir}"), "sidecar {dir}: is a directory"),
    Case("convert", "-o in a read-only directory", (S, "-o", "{readonly}/s.pi2.gguf"),
         "cannot create files in {readonly}: Permission denied", unprivileged=True),
    Case("convert", "-o the model itself", (S, "-o", S), "the sidecar would overwrite the model"),
    Case("convert", "negative --sparsity", (S, "--sparsity=-0.5"), "sparsity must be in [0, 1), got -0.5"),
    Case("convert", "--sparsity of 1", (S, "--sparsity", "1"), "sparsity must be in [0, 1), got 1.0"),
    Case("convert", "NaN --sparsity", (S, "--sparsity", "nan"), "sparsity must be in [0, 1), got nan"),
    Case("convert", "huge --sparsity", (S, "--sparsity", "1e300"), "sparsity must be in [0, 1), got 1e+300"),
    Case("convert", "non-number --sparsity", (S, "--sparsity", "half"), "argument --sparsity: invalid float value"),
    Case("convert", "infinite --threshold", (S, "--criterion", "act", "--threshold", "inf"),
         "threshold must be a finite number >= 0, got inf"),
    Case("convert", "negative --threshold", (S, "--criterion", "act", "--threshold=-1"), "threshold must be a finite"),
    Case("convert", "--recall above 1", (S, "--recall", "2"), "recall target must be in [0.5, 1), got 2.0"),
    Case("convert", "zero --ranks", (S, "--ranks", "0,16"), "argument --ranks: '0,16': a predictor width must be"),
    Case("convert", "huge --ranks", (S, "--ranks", "16,99999"), "--ranks 16,99999: a predictor width is 2 to 1152"),
    Case("convert", "malformed --ranks", (S, "--ranks", "16,"), "argument --ranks: '16,' is not a comma-separated"),
    Case("convert", "missing --profile", (S, "--profile", "{missing}"), "profile not found: {missing}"),
    Case("convert", "FIFO as --profile", (S, "--profile", "{fifo}"), "profile path is not a file: {fifo}"),
    Case("convert", "not a profile", (S, "--profile", "{notgguf}"), "{notgguf} is not a pi2 profile"),
    Case("convert", "missing --checkpoint", (S, "--checkpoint", "{missing}"),
         "--checkpoint {missing}: not a directory"),
    Case("convert", "--bundle-align not a choice", (S, "--bundle-align", "1000"),
         "argument --bundle-align: invalid choice"),
    Case("convert", "--output-rows past PI2_OUTPUT_ROWS's range", (S, "--output-rows", "5000"),
         "argument --output-rows: 5000 is out of range (from 0 to 4096)"),
    Case("convert", "negative --output-rows", (S, "--output-rows=-1"), "argument --output-rows: -1 is out of range"),
    Case("convert", "zero --bundle-neurons", (S, "--bundle-neurons", "0"), "argument --bundle-neurons: invalid choice"),
    Case("convert", "--dense-reads not a choice", (S, "--dense-reads", "whole"), "argument --dense-reads: invalid choice"),
    Case("convert", "--bundle-type not a type", (S, "--bundle-type", "q5"), "--bundle-type 'q5' is not a ggml type name"),
    Case("convert", "--bundle-type whose blocks do not fit", (S, "--bundle-type", "q3_k"),
         "bundle type q3_k has blocks of 256 values, which do not divide this model's rows of n_embd = 576"),
    Case("convert", "--down-type not a type", (S, "--down-type", "q8"), "--down-type 'q8' is not a ggml type name"),
    Case("convert", "--bundle-type-layers past the model", (S, "--bundle-type", "q4_0", "--bundle-type-layers", "0-99"),
         "--bundle-type-layers '0-99': '0-99' is not within the model's layers 0-29"),
    Case("convert", "--bundle-type-layers without --bundle-type", (S, "--bundle-type-layers", "1"),
         "--bundle-type-layers needs --bundle-type"),
    Case("convert", "--down-type that needs an importance matrix", (S, "--down-type", "iq2_xxs"),
         "--down-type: bundle type iq2_xxs is not one ggml quantizes without an importance matrix"),
    Case("convert", "huge --bundle-align", (S, "--bundle-align", "99999999999"),
         "argument --bundle-align: invalid choice: 99999999999"),
    Case("convert", "zero --epochs", (S, "--epochs", "0"), "argument --epochs: 0 is out of range"),
    Case("convert", "malformed --perplexity-budget", (S, "--perplexity-budget", "lots"),
         "argument --perplexity-budget: 'lots' is not a percentage or 'none'"),
    Case("convert", "--perplexity-budget over 100", (S, "--perplexity-budget", "150"),
         "argument --perplexity-budget: 150 is not a percentage from 0 to 100"),
    Case("convert", "negative --train-tokens", (S, "--train-tokens", "-5"), "argument --train-tokens: -5 is out"),
    Case("convert", "missing --text", (S, "--text", "{missing}"), "text file not found: {missing}"),
    Case("convert", "--window past the training context", (S, "--window", "100000"),
         "--window 100000: more than the 8192"),
    Case("convert", "--text too short to profile", (S, "--text", "{short_text}"), "the corpus short.txt gives only"),
    Case("convert", "zero --threads", (S, "-t", "0"), "argument -t/--threads: 0 is out of range"),
    # --- inspect ---
    Case("inspect", "missing sidecar", ("{missing}",), "sidecar not found: {missing}"),
    Case("inspect", "directory as sidecar", ("{dir}",), "sidecar path is not a file: {dir}"),
    Case("inspect", "FIFO as sidecar", ("{fifo}",), "sidecar path is not a file: {fifo}"),
    Case("inspect", "unreadable sidecar", ("{unreadable}",), "cannot read sidecar {unreadable}", unprivileged=True),
    Case("inspect", "not a GGUF file", ("{notgguf}",), "{notgguf} is not a GGUF file"),
    Case("inspect", "truncated sidecar", ("{truncated_sidecar}",), "{truncated_sidecar}"),
    Case("inspect", "model given as sidecar", (S,), "{smol} is not a pi2 sidecar"),
    Case("inspect", "--png in a missing directory", (B, "--png", "{nodir}/h.png"), "--png {nodir}/h.png: directory"),
    Case("inspect", "--png a directory", (B, "--png", "{dir}"), "--png {dir}: is a directory"),
    Case("inspect", "--png in a read-only directory", (B, "--png", "{readonly}/h.png"),
         "cannot create files in {readonly}: Permission denied", unprivileged=True),
    # --- perplexity ---
    Case("perplexity", "missing model file", ("{missing}",), "model file not found: {missing}"),
    Case("perplexity", "truncated GGUF", ("{truncated}",), "{truncated}: is truncated"),
    Case("perplexity", "sidecar given as model", ("{sidecar}",), "is a pi2 sidecar, not a model"),
    Case("perplexity", "GGUF of an unknown architecture", ("{foreign}",), "architecture 'nosuch'"),
    Case("perplexity", "SmolLM2 sidecar for Gemma-3", ("{gemma}", "--sidecar", B), "was made for another model"),
    Case("perplexity", "missing --text", (S, "--text", "{missing}"), "text file not found: {missing}"),
    Case("perplexity", "directory as --text", (S, "--text", "{dir}"), "text file {dir} is not a regular file"),
    Case("perplexity", "--text shorter than one chunk", (S, "--text", "{short_text}"), "the text has"),
    Case("perplexity", "--ctx too small", (S, "-c", "8"), "argument -c/--ctx: 8 is out of range"),
    Case("perplexity", "--ctx past the training context", (S, "-c", "9000"), "-c/--ctx 9000: more than the 8192"),
    Case("perplexity", "zero --chunks", (S, "--chunks", "0"), "argument --chunks: 0 is out of range"),
    Case("perplexity", "huge --chunks", (S, "--chunks", "99999999999"), "argument --chunks: 99999999999 is out"),
    Case("perplexity", "zero --threads", (S, "-t", "0"), "argument -t/--threads: 0 is out of range"),
    Case("perplexity", "sparse mode without sidecar", (S, "--mode", "oracle"), "mode oracle needs a sidecar"),
    Case("perplexity", "--all-layers with --no-plugin", (S, "--all-layers", "--no-plugin"),
         "--all-layers needs the plugin"),
    Case("perplexity", "--memory-budget without a sidecar", (S, "--memory-budget", "2GB"),
         "a memory budget needs the model's sidecar"),
    Case("perplexity", "--with a malformed setting", (S, "--with", "output_rows"),
         "argument --with: 'output_rows' is not NAME=VALUE"),
    # --- bench (each refused before it runs a configuration) ---
    Case("bench", "missing model file", ("{missing}", "--memory-limit", "300MB"), "model file not found: {missing}"),
    Case("bench", "sidecar given as model", ("{sidecar}", "--memory-limit", "300MB"), "is a pi2 sidecar, not a model"),
    Case("bench", "no sidecar beside the model", (S, "--memory-limit", "300MB"), "smol.pi2.gguf: not found"),
    Case("bench", "SmolLM2 sidecar for Gemma-3", ("{gemma}", "--sidecar", B, "--memory-limit", "300MB"),
         "was made for another model"),
    Case("bench", "truncated sidecar", (S, "--sidecar", "{truncated_sidecar}", "--memory-limit", "300MB"),
         "{truncated_sidecar}: is truncated"),
    Case("bench", "malformed --memory-limit", (S, "--sidecar", B, "--memory-limit", "12XB"),
         "--memory-limit '12XB' is not a size"),
    Case("bench", "zero --memory-limit", (S, "--sidecar", B, "--memory-limit", "0"),
         "--memory-limit '0' is not a positive"),
    Case("bench", "negative --memory-limit", (S, "--sidecar", B, "--memory-limit=-1MB"), "--memory-limit '-1MB'"),
    Case("bench", "NaN --memory-limit", (S, "--sidecar", B, "--memory-limit", "nan"), "--memory-limit 'nan' is not"),
    Case("bench", "--memory-limit above the machine's memory", (S, "--sidecar", B, "--memory-limit", "1000TB"),
         "--memory-limit 1000TB is more than this machine's memory"),
    Case("bench", "malformed --read-bps", (S, "--sidecar", B, "--memory-limit", "300MB", "--read-bps", "fast"),
         "--read-bps 'fast' is not a size"),
    Case("bench", "--peer without a command", (S, "--sidecar", B, "--memory-limit", "300MB", "--peer", "bmoe"),
         "--peer 'bmoe' is not NAME=COMMAND"),
    Case("bench", "--peer with an unknown placeholder", (S, "--sidecar", B, "--memory-limit", "300MB", "--peer",
                                                          "bmoe=bmoe-cli -m {{path}}"), "unknown placeholder"),
    Case("bench", "zero --rounds", (S, "--sidecar", B, "--memory-limit", "300MB", "--rounds", "0"),
         "argument --rounds: 0 is out of range"),
    Case("bench", "zero -n", (S, "--sidecar", B, "--memory-limit", "300MB", "-n", "0"),
         "argument -n: 0 is out of range"),
    Case("bench", "-n beyond the context", (S, "--sidecar", B, "--memory-limit", "300MB", "-n", "600"), "-n 600"),
    Case("bench", "zero --threads", (S, "--sidecar", B, "--memory-limit", "300MB", "--threads", "0"),
         "argument --threads: 0 is out of range"),
    Case("bench", "--ctx past the training context", (S, "--sidecar", B, "--memory-limit", "300MB", "--ctx", "10000"),
         "--ctx 10000: more than the 8192"),
    Case("bench", "NaN --timeout", (S, "--sidecar", B, "--memory-limit", "300MB", "--timeout", "nan"),
         "argument --timeout: nan is not a positive number of seconds"),
    Case("bench", "negative --timeout", (S, "--sidecar", B, "--memory-limit", "300MB", "--timeout=-5"),
         "argument --timeout: -5 is not a positive number of seconds"),
    Case("bench", "missing --memory-limit", (S,), "one of the arguments --memory-limit --sweep is required"),
    Case("bench", "--sweep with --memory-limit", (S, "--sidecar", B, "--memory-limit", "300MB", "--sweep", "50%"),
         "argument --sweep: not allowed with argument --memory-limit"),
    Case("bench", "malformed --sweep entry", (S, "--sidecar", B, "--sweep", "50%,abc"), "--sweep entry 'abc' is not"),
    Case("bench", "zero --sweep percentage", (S, "--sidecar", B, "--sweep", "0%,50%"),
         "--sweep entry '0%' is not a positive percentage"),
    Case("bench", "negative --sweep percentage", (S, "--sidecar", B, "--sweep=-5%"),
         "--sweep entry '-5%' is not a positive percentage"),
    Case("bench", "empty --sweep", (S, "--sidecar", B, "--sweep", ""), "--sweep '' lists no memory limits"),
    Case("bench", "--sweep with an empty entry", (S, "--sidecar", B, "--sweep", "25%,,50%"),
         "--sweep '25%,,50%': entry 2 is empty"),
    Case("bench", "--sweep above the machine's memory", (S, "--sidecar", B, "--sweep", "50%,1000TB"),
         "--sweep entry '1000TB' (1000000000 MB) is more than this machine's memory"),
    Case("bench", "--sweep with --with", (S, "--sidecar", B, "--sweep", "50%", "--with", "output_rows=64"),
         "--sweep compares stock llama.cpp with one pi2 sidecar; drop --with"),
    Case("bench", "--sweep with two --mode", (S, "--sidecar", B, "--sweep", "50%", "--mode", "predicted", "--mode", "dense"),
         "--sweep compares stock llama.cpp with one pi2 sidecar; drop the second --mode"),
    Case("bench", "--png without --sweep", (S, "--sidecar", B, "--memory-limit", "300MB", "--png", "s.png"),
         "--png plots a --sweep"),
    Case("bench", "--png in a missing directory", (S, "--sidecar", B, "--sweep", "50%", "--png", "{nodir}/s.png"),
         "--png {nodir}/s.png: directory {nodir} does not exist"),
    Case("bench", "--with without a value", (S, "--sidecar", B, "--memory-limit", "300MB", "--with", "output_rows"),
         "argument --with: 'output_rows' is not NAME=VALUE"),
    Case("bench", "--with a malformed value", (S, "--sidecar", B, "--memory-limit", "300MB", "--with", "output_rows=lots"),
         "--with output_rows=lots: PI2_OUTPUT_ROWS=lots is not"),
]
