"""`pi2-gguf bench --peer NAME=COMMAND` (pi2_gguf/bench/peers.py): the template, and the rates read from what a peer
printed (BigMoeOnEdge's report as its cli prints it, and llama.cpp's perf lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pi2_gguf.bench.peers import Peer, parse_output, parse_peer, peer_command, peer_files
from pi2_gguf.errors import Pi2Error

BMOE_REPORT = """\
=== perf ===
generation: 32 tokens, 0.118 s/token (8.475 tok/s)
compute: 61.3% CPU occupancy (0.0723 cpu-s/token over 1 threads), 0.00 major faults/token
prefill: 27 tokens, 1.904 s (14.2 tok/s) | model load 0.412 s | TTFT 1.950 s
moe-stream: read 2563.0 MiB (80.09 MiB/token), decode 0.118 s/token
moe-cache: 13.5% hit, resident 47.0 MiB, budget 48 MiB (auto)
"""

LLAMA_PERF = """\
llama_perf_context_print:        load time =     512.31 ms
llama_perf_context_print: prompt eval time =     200.00 ms /    27 tokens (    7.41 ms per token,   135.00 tokens per second)
llama_perf_context_print:        eval time =    1600.00 ms /    31 runs   (   51.61 ms per token,    19.38 tokens per second)
llama_perf_context_print:       total time =    1900.00 ms /    58 tokens
"""

# SmallThinker's engine (PowerInfer's smallthinker/ llama.cpp fork: llama-cli streaming from an expert bundle), the end
# of its stderr as it printed it on a 4-layer synthetic smallthinker model here (2026-11-28); the sampler's line,
# printed first, is not the decode rate
SMALLTHINKER_CLI = """\
generate: n_ctx = 4096, n_batch = 2048, n_predict = 32, n_keep = 0

llama_perf_sampler_print:    sampling time =       1.61 ms /    39 runs   (    0.04 ms per token, 24178.55 tokens per second)
llama_perf_context_print:        load time =     171.26 ms
llama_perf_context_print: prompt eval time =     320.64 ms /     7 tokens (   45.81 ms per token,    21.83 tokens per second)
llama_perf_context_print:        eval time =      73.74 ms /    31 runs   (    2.38 ms per token,   420.38 tokens per second)
llama_perf_context_print:       total time =     405.40 ms /    38 tokens
"""


def test_bmoe_report_gives_its_rates() -> None:
    got = parse_output(BMOE_REPORT)
    assert got is not None
    assert (got.decode_tps, got.decoded, got.prompt_tps) == (8.475, 32, 14.2)
    assert got.read_per_token_mb == pytest.approx(80.09 * 2**20 / 1e6)
    assert got.expert_hit_rate == pytest.approx(0.135)


def test_other_engines_give_their_last_rate() -> None:
    got = parse_output(LLAMA_PERF)
    assert got is not None and got.decode_tps == 19.38 and got.read_per_token_mb is None
    assert parse_output("done: 12.5 tok/s\n") == parse_output("12.5 tokens/s")
    assert parse_output("no rate here\n") is None


def test_llama_cpp_timing_lines_give_prompt_and_decode_rates() -> None:
    got = parse_output("Load expert bundle from \"m.bundle\".\nWrite a Python function\n" + SMALLTHINKER_CLI)
    assert got is not None
    assert (got.decode_tps, got.decoded, got.prompt_tps) == (420.38, 31, 21.83)
    assert got.read_per_token_mb is None and got.expert_hit_rate is None
    got = parse_output(LLAMA_PERF)
    assert got is not None and (got.decode_tps, got.decoded, got.prompt_tps) == (19.38, 31, 135.0)
    # no decode timed (-n 1): llama.cpp prints nan or inf, which is no rate
    got = parse_output("llama_perf_context_print:        eval time =       0.00 ms /     0 runs   (    -nan ms per "
                       "token,     -nan tokens per second)\n")
    assert got is not None and got.decode_tps == 0.0 and got.decoded == 0


def test_command_template_fills_each_argument() -> None:
    peer = parse_peer("bmoe=bin/bmoe-cli -m {model} -p {prompt} -n {n} -t {threads} --cache-mb 96")
    assert peer == Peer("bmoe", "bin/bmoe-cli -m {model} -p {prompt} -n {n} -t {threads} --cache-mb 96")
    cmd = peer_command(peer, "/m/a model.gguf", "Write a function", 32, 1)
    assert cmd == ["bin/bmoe-cli", "-m", "/m/a model.gguf", "-p", "Write a function", "-n", "32", "-t", "1",
                   "--cache-mb", "96"]


@pytest.mark.parametrize("text, why", [
    ("bmoe", "is not NAME=COMMAND"),
    ("=bmoe-cli -m {model}", "is not NAME=COMMAND"),
    ("bmoe=", "is not NAME=COMMAND"),
    ("bmoe=bmoe-cli -m {modle}", "unknown placeholder"),
    ("bmoe=bmoe-cli -m {model", "stray brace"),
    ("bmoe=bmoe-cli -p 'unclosed", "does not parse"),
])
def test_malformed_peer_is_refused(text: str, why: str) -> None:
    with pytest.raises(Pi2Error, match=why):
        parse_peer(text)


def test_peer_files_are_the_existing_files_its_command_names(tmp_path: Path) -> None:
    binary, model, bundle = tmp_path / "llama-cli", tmp_path / "st-T.gguf", tmp_path / "st.bundle"
    for f in (binary, model, bundle):
        f.write_bytes(b"x")
    binary.chmod(0o755)
    peer = parse_peer(f"st=env MAX_N_CACHED=768 EXPERT_BUNDLE_PATH={bundle} {binary} -m {model} -p {{prompt}} "
                      f"-n {{n}} -o {tmp_path / 'absent.txt'}")
    assert peer_files(peer) == [bundle, model]


def test_bench_drops_the_peers_files_page_cache_too(tmp_path: Path) -> None:
    """Every configuration of a bench starts cold: the files whose page cache is dropped before each run are the
    model, its sidecars and the files peers' commands name (a peer's own model file and bundle)."""
    from pi2_gguf.bench.memory_limit import bench_runs

    binary, model, own, bundle, sidecar = (tmp_path / n for n in ("cli", "m.gguf", "m-T.gguf", "m.bundle", "m.pi2.gguf"))
    for f in (binary, model, own, bundle, sidecar):
        f.write_bytes(b"x")
    binary.chmod(0o755)
    peer = parse_peer(f"st=env EXPERT_BUNDLE_PATH={bundle} {binary} -m {own} -p {{prompt}} -n {{n}}")
    runs = bench_runs(model, [sidecar], 1 << 30, None, 8, 2, 128, None, 60.0, skip_unlimited=True, peers=[peer])
    for _, run in runs:
        assert run.args[3] == [model, sidecar, bundle, own]  # measure(row, cmd, mem, files, ...)


def test_bench_runs_one_pi2_row_per_mode_each_named(tmp_path: Path) -> None:
    """--mode repeated: one pi2 row per mode under the limit, each naming its mode and passing it to the run (mode
    dense under a budget reads every neuron, beside predicted's sparse reads); the in-RAM row takes the first."""
    from pi2_gguf.bench.memory_limit import bench_runs

    model, sidecar = tmp_path / "m.gguf", tmp_path / "m.pi2.gguf"
    for f in (model, sidecar):
        f.write_bytes(b"x")
    runs = bench_runs(model, [sidecar], 300_000_000, None, 8, 2, 128, ["predicted", "dense"], 60.0)
    names = [row.name for row, _ in runs]
    assert names[-3:] == ["pi2, memory budget 300 MB, mode predicted", "pi2, memory budget 300 MB, mode dense",
                          "pi2, all in RAM (no limit)"]
    cmds = [run.args[1] for _, run in runs]  # measure(row, cmd, mem, files, ...)
    modes = [c[c.index("--mode") + 1] if "--mode" in c else None for c in cmds]
    assert modes == [None, None, "predicted", "dense", "predicted"]
    one = bench_runs(model, [sidecar], 300_000_000, None, 8, 2, 128, None, 60.0)
    assert [row.name for row, _ in one][2] == "pi2, memory budget 300 MB"  # one mode: the name as before
