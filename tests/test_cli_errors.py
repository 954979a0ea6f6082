"""Every pi2-gguf command with bad input (tests/cli_bad_inputs.py): exit code 2, one line on stderr naming the
problem, no traceback, and nothing written; and a symlinked model's sidecar is the one beside the link."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from cli_bad_inputs import CASES, CLI, Case, Inputs, run_case, unprivileged_works  # noqa: E402

from pi2_gguf.assets import models  # noqa: E402
from pi2_gguf.sidecar import format as fmt  # noqa: E402


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under d (symlinks not followed) with its size and mtime: what a refused command must not change."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                out[str(p.relative_to(d))] = (st.st_size, st.st_mtime_ns)
            else:
                out[str(p.relative_to(d))] = (-1, -1)
    return out


@pytest.fixture(scope="module")
def inputs(smollm2: Path, gemma3: Path, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[Inputs]:
    """The bad inputs beside hard links of SmolLM2 and Gemma-3 and SmolLM2's sidecar: the one `make run` left
    in the model cache if the plugin accepts it (no conversion), else the session's converted one."""
    from pi2_gguf.errors import SidecarError
    from pi2_gguf.runtime.native import validate_sidecar_c

    cached = fmt.sidecar_path_for(models.model_path("smollm2-135m"))
    try:
        validate_sidecar_c(cached)
        sidecar = cached
    except SidecarError:
        sidecar = request.getfixturevalue("smol_sidecar")
    ins = Inputs(tmp_path_factory.mktemp("bad-inputs"), smollm2, gemma3, sidecar)
    yield ins
    ins.close()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_code_2(case: Case, inputs: Inputs) -> None:
    if case.needs and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"needs {case.needs}")
    if case.unprivileged and not unprivileged_works(inputs.dir):
        pytest.skip("cannot make a file unreadable to this process")
    before = _listing(inputs.dir)
    res = run_case(case, inputs, timeout=120)
    lines = res.stderr.splitlines()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 2, f"{' '.join(res.argv)}: exit {res.returncode}\n{res.stderr[-3000:]}"
    assert len(lines) == 1, f"{' '.join(res.argv)}: stderr is not one line:\n{res.stderr[-3000:]}"
    assert lines[0].startswith("pi2-gguf"), lines[0]
    assert inputs.format(case.expect) in lines[0], lines[0]
    assert _listing(inputs.dir) == before  # nothing written, nothing left behind, no input touched


# --- a symlinked model: its sidecar is the one beside the link -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> tuple[Path, Path]:
    """(a small synthetic ReLU model, a text to profile it on): converted in seconds."""
    from gguf import GGMLQuantizationType as QT

    from pi2_gguf.converter import synthetic

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_checkpoint import TEXT

    d = tmp_path_factory.mktemp("tiny")
    model = d / "tiny.gguf"
    synthetic.make(model, synthetic.Shape(n_embd=64, n_ff=256, n_layer=2, n_head=2, n_head_kv=1, n_ctx=256),
                   synthetic.Sparsity(density=0.2), "relu", QT.F32, tokenizer_from=smollm2, calib_tokens=128,
                   heldout_tokens=64, progress=False)
    text = d / "text.txt"
    text.write_text("\n\n".join([TEXT] * 12))
    return model, text


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    res = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _sidecar_line(stdout: str) -> str | None:
    return next((line.split(None, 1)[1] for line in stdout.splitlines() if line.startswith("sidecar ")), None)


def test_symlinked_model_gets_its_sidecar_beside_the_link(tiny_model: tuple[Path, Path], tmp_path: Path) -> None:
    model, text = tiny_model
    target = tmp_path / "store" / "tiny.gguf"  # the model under a directory of its own, hard-linked
    target.parent.mkdir()
    os.link(model, target)
    link = tmp_path / "links" / "mine.gguf"
    link.parent.mkdir()
    link.symlink_to(target)
    before = target.stat()

    _cli("convert", str(link), "--text", str(text), "--train-tokens", "256", "--heldout-tokens", "64",
         "--window", "64", "-t", "2", cwd=tmp_path)
    beside_link = tmp_path / "links" / "mine.pi2.gguf"
    assert beside_link.is_file() and not beside_link.is_symlink()
    assert not (tmp_path / "store" / "tiny.pi2.gguf").exists()  # not beside the target
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["links", "mine.gguf", "mine.pi2.gguf", "store", "tiny.gguf"]
    after = target.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)

    # loading through the link finds it (run, perplexity); loading the target does not
    through_link = _cli("run", str(link), "-n", "4", "-t", "2", cwd=tmp_path)
    assert _sidecar_line(through_link.stdout) == str(beside_link) and "mode predicted" in through_link.stdout
    direct = _cli("run", str(target), "-n", "4", "-t", "2", cwd=tmp_path)
    assert _sidecar_line(direct.stdout) is None and "mode dense" in direct.stdout
    ppl = _cli("perplexity", str(link), "--text", str(text), "-c", "128", "--chunks", "1", "-t", "2", cwd=tmp_path)
    assert "mode predicted" in ppl.stdout
    ppl = _cli("perplexity", str(target), "--text", str(text), "-c", "128", "--chunks", "1", "-t", "2", cwd=tmp_path)
    assert "mode dense" in ppl.stdout

    # the library's default lookup too (pi2_gguf.Llama, as serve and the demo's runs load it)
    from pi2_gguf.runtime.llama import resolve_sidecar

    assert resolve_sidecar(link, None) == beside_link
    assert resolve_sidecar(target, None) is None


def test_relative_symlink_in_another_directory(tiny_model: tuple[Path, Path], tmp_path: Path) -> None:
    """A relative link: the default sidecar is beside the link as named, from any working directory."""
    from pi2_gguf.gguf_file import check_model_file
    from pi2_gguf.runtime.llama import resolve_sidecar

    model, _ = tiny_model
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    os.link(model, tmp_path / "a" / "m.gguf")
    (tmp_path / "b" / "m.gguf").symlink_to(Path("..") / "a" / "m.gguf")
    shutil.copyfile(model, tmp_path / "b" / "m.pi2.gguf")  # a stand-in: only its place matters here
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "b")
        path = check_model_file("m.gguf")
        assert path == tmp_path / "b" / "m.gguf"
        assert resolve_sidecar(path, None) == tmp_path / "b" / "m.pi2.gguf"
    finally:
        os.chdir(cwd)


def test_every_subcommand_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    """`pi2-gguf CMD -h` works for every command (a bare % in a help string made argparse raise instead)."""
    from pi2_gguf.cli import build_parser, main

    commands = list(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert "convert" in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as e:
            main([cmd, "-h"])
        assert e.value.code == 0, cmd
        assert "usage:" in capsys.readouterr().out
