#!/usr/bin/env python3
"""Runs every pi2-gguf command with every bad input of tests/cli_bad_inputs.py and writes a markdown table:
the command line, its exit code and what it printed on stderr (one line expected).

    .venv/bin/python tools/cli_bad_input_table.py [-o build/cli_bad_input_table.md] [--installed] [-k TEXT]

The inputs are made in a temporary directory (SmolLM2 and Gemma-3 hard-linked from the model cache, SmolLM2's
sidecar from beside the cached model, or converted there once with small settings). Commands run in that
directory, so paths read as a user typed them. By default the checkout's pi2_gguf runs (this repository on
PYTHONPATH); --installed runs the package installed in this interpreter's environment."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def _sidecar(smol: Path) -> Path:
    from pi2_gguf.errors import SidecarError
    from pi2_gguf.runtime.native import validate_sidecar_c
    from pi2_gguf.sidecar import format as fmt

    cached = fmt.sidecar_path_for(smol)
    try:
        validate_sidecar_c(cached)
        return cached
    except SidecarError:
        from pi2_gguf.converter.convert import convert

        print(f"converting {smol.name} once for its sidecar ({cached}) ...", file=sys.stderr)
        return convert(smol, cached, train_tokens=1024, heldout_tokens=256, ranks=[64], perplexity_budget=None).path


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "build" / "cli_bad_input_table.md")
    ap.add_argument("--installed", action="store_true", help="run the installed pi2_gguf, not the checkout's")
    ap.add_argument("-k", help="only the cases whose id contains this")
    args = ap.parse_args()
    if not args.installed:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

    from cli_bad_inputs import CASES, Inputs, run_case, unprivileged_works

    from pi2_gguf.assets import models

    smol = models.fetch("smollm2-135m", progress=False)
    gemma = models.fetch("gemma3-270m", progress=False)
    cases = [c for c in CASES if not args.k or args.k in c.id]
    rows, ok = [], 0
    with tempfile.TemporaryDirectory(prefix="pi2-bad-inputs-") as tmp:
        inputs = Inputs(Path(tmp), smol, gemma, _sidecar(smol))
        try:
            dropped = unprivileged_works(inputs.dir)
            t0 = time.time()
            for case in cases:
                res = run_case(case, inputs)
                lines = res.stderr.strip().splitlines()
                one_line = len(lines) == 1 and "Traceback" not in res.stderr
                named = one_line and inputs.format(case.expect) in lines[0]
                good = res.returncode == 2 and one_line and named
                ok += good
                how = " (without DAC override)" if case.unprivileged and dropped and os.geteuid() == 0 else ""
                env = "".join(f"{k}={inputs.format(v)} " for k, v in case.env.items())
                rows.append(f"| {case.command} | {_cell(case.what + how)} | `{_cell(env + ' '.join(res.argv))}` | "
                            f"{res.returncode}{'' if good else ' **not as expected**'} | {_cell(res.stderr.strip())} |")
                print(f"{'ok ' if good else 'BAD'} {case.id}", file=sys.stderr)
            seconds = time.time() - t0
        finally:
            inputs.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    head = (f"# pi2-gguf with bad input\n\n{ok} of {len(cases)} cases end in exit code 2 and one stderr line naming the "
            f"problem, no traceback ({seconds:.0f} s; made by tools/cli_bad_input_table.py, cases in "
            "tests/cli_bad_inputs.py).\n\n"
            "| command | bad input | command line | exit | stderr |\n|---|---|---|---|---|\n")
    tmp_out = args.output.with_name(f".{args.output.name}.tmp")
    tmp_out.write_text(head + "\n".join(rows) + "\n")
    tmp_out.replace(args.output)
    print(f"{ok}/{len(cases)} as expected -> {args.output}", file=sys.stderr)
    return 0 if ok == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
