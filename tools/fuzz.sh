#!/usr/bin/env bash
# libFuzzer targets (ASan + UBSan) for every reader of file bytes in the plugin (ggml-backend/fuzz/).
#
#   tools/fuzz.sh --list                          the target names
#   tools/fuzz.sh TARGET MINUTES [--runs N]       build if sources changed, fuzz one target (one process) for
#                                                 MINUTES (fractions allowed) or N executions, whichever first
#   tools/fuzz.sh --build TARGET                  build only; prints the binary's path
#   tools/fuzz.sh --replay TARGET FILE|DIR...     run each input once (regression inputs)
#   tools/fuzz.sh --coverage TARGET               line/branch coverage of the target's plugin files over its
#                                                 work corpus, seeds and regression inputs (llvm-cov)
# Options before TARGET: --corpus DIR (the work corpus; default build/fuzz/corpus/TARGET), --no-seeds.
#
# Seeds come from ggml-backend/fuzz/make_seeds.py, made once into build/fuzz/seeds/ (remade when it, the
# converter or the cached models change); new inputs go to the work corpus, crash inputs to
# build/fuzz/artifacts/TARGET/. Exits nonzero on any crash, leak, timeout, out-of-memory or sanitizer report,
# naming the input that caused it; a found input belongs, once fixed, in tests/fuzz_regressions/TARGET/.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
CC="${FUZZ_CC:-clang}"
PY="$ROOT/.venv/bin/python"
OUT="$ROOT/build/fuzz"
FUZZ_SRC="ggml-backend/fuzz"
TARGETS=(sidecar model_summary embedding_rows config)

# the plugin's files each target links (compiled with the sanitizers), and its -max_len
sources() {
    case "$1" in
        sidecar)        echo "model/sidecar.c model/gguf_file.c model/fingerprint.c flash/bundle_io.c flash/io_ring.c core/config.c" ;;
        model_summary)  echo "model/model_file.c model/gguf_file.c model/fingerprint.c graph/ffn_names.c flash/bundle_io.c flash/io_ring.c" ;;
        embedding_rows) echo "flash/embedding_rows.c flash/bundle_io.c flash/io_ring.c" ;;
        config)         echo "core/config.c graph/ffn_names.c" ;;
        *) echo "fuzz.sh: unknown target '$1' (tools/fuzz.sh --list)" >&2; return 1 ;;
    esac
}
max_len() {
    case "$1" in
        sidecar|model_summary) echo 131072 ;;
        embedding_rows)        echo 131072 ;;
        config)                echo 8192 ;; # a PI2_SIDECAR longer than PI2_PATH_MAX fits
    esac
}

die() { echo "fuzz.sh: $*" >&2; exit 2; }

need_clang() {
    command -v "$CC" >/dev/null 2>&1 || die "$CC not found (apt-get install clang: clang 14+ with libFuzzer)"
    [ -x "$PY" ] || die "$PY missing: run python3 tools/bootstrap.py first"
}

ggml_dir() {
    "$PY" -c "from pi2_gguf import llama_build; from pathlib import Path; print(llama_build.ensure_wheel(Path('patches')).ggml_dir)"
}

lib_dir() {
    local d
    for d in "$ROOT"/.venv/lib/python3*/site-packages/llama_cpp/lib; do
        [ -e "$d/libggml-base.so.0" ] && { echo "$d"; return; }
    done
    die "no llama_cpp/lib/libggml-base.so.0 in .venv (python3 tools/bootstrap.py)"
}

# builds build/fuzz/bin/fuzz_TARGET unless its sources, flags and compiler are those of the last build
build() {
    local target="$1" srcs f
    srcs="$(sources "$target")"
    need_clang
    local ggml lib
    ggml="$(ggml_dir)"
    lib="$(lib_dir)"
    local cflags=(-std=c11 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
                  -Wall -Wextra -DGGML_BACKEND_DL -DGGML_BACKEND_BUILD -DGGML_BACKEND_SHARED -DGGML_SHARED -DGGML_BUILD
                  -D_POSIX_C_SOURCE=200809L "-I$ROOT/ggml-backend/include" "-I$ROOT/ggml-backend/src" "-I$ggml/include" "-I$ggml/src")
    local files=("$FUZZ_SRC/fuzz_$target.c" "$FUZZ_SRC/fuzz_common.h")
    for f in $srcs; do files+=("ggml-backend/src/$f"); done
    local key
    key="$( { "$CC" --version | head -1; echo "${cflags[*]} $lib"; cat "${files[@]}" ggml-backend/src/*/*.h ggml-backend/include/*.h; } | sha256sum | cut -c1-16)"
    local bin="$OUT/bin/fuzz_$target"
    if [ -x "$bin" ] && [ "$(cat "$bin.key" 2>/dev/null)" = "$key" ]; then
        echo "$bin"
        return
    fi
    mkdir -p "$OUT/bin" "$OUT/obj/$target"
    local objs=()
    for f in $srcs; do
        "$CC" "${cflags[@]}" -fsanitize=fuzzer-no-link -c "ggml-backend/src/$f" -o "$OUT/obj/$target/${f//\//_}.o" >&2
        objs+=("$OUT/obj/$target/${f//\//_}.o")
    done
    # the harness alone needs _GNU_SOURCE (memfd_create)
    "$CC" "${cflags[@]}" -D_GNU_SOURCE -fsanitize=fuzzer "$FUZZ_SRC/fuzz_$target.c" "${objs[@]}" -o "$bin.tmp" \
        -L"$lib" -l:libggml-base.so.0 -Wl,-rpath,"$lib" -lpthread -lm >&2
    mv "$bin.tmp" "$bin"
    echo "$key" > "$bin.key"
    echo "$bin"
}

# build/fuzz/seeds/, remade when make_seeds.py, the converter or the cached models change
seeds() {
    local models="$HOME/.cache/pi2-gguf/models" key
    key="$( { cat "$FUZZ_SRC/make_seeds.py" tests/sidecar_factory.py pi2_gguf/converter/*.py pi2_gguf/sidecar/*.py;
              stat -c '%n %s %Y' "$models"/SmolLM2-135M-Instruct.Q4_1.gguf "$models"/SmolLM2-135M-Instruct.Q4_1.pi2.gguf \
                  "$models"/gemma-3-270m-q4_k_m.gguf 2>/dev/null || true; } | sha256sum | cut -c1-16)"
    [ "$(cat "$OUT/seeds/.key" 2>/dev/null)" != "$key" ] || return 0
    mkdir -p "$OUT"
    ( # one maker at a time; a second fuzz.sh waits for the first one's seeds
        flock 9
        if [ "$(cat "$OUT/seeds/.key" 2>/dev/null)" != "$key" ]; then
            echo "fuzz.sh: making seed corpora (about 90 s, once)" >&2
            "$PY" "$FUZZ_SRC/make_seeds.py" "$OUT/seeds" >&2
            echo "$key" > "$OUT/seeds/.key"
        fi
    ) 9>"$OUT/seeds.lock"
}

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }

# a build without sanitizers that records coverage, run once over every input the target has
coverage() {
    local target="$1" srcs f ggml lib ver
    srcs="$(sources "$target")"
    need_clang
    ver="$("$CC" --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)"
    local profdata cov
    profdata="$(command -v "llvm-profdata-$ver" || command -v llvm-profdata)" || die "llvm-profdata missing"
    cov="$(command -v "llvm-cov-$ver" || command -v llvm-cov)" || die "llvm-cov missing"
    ggml="$(ggml_dir)"
    lib="$(lib_dir)"
    local cflags=(-std=c11 -g -O0 -fprofile-instr-generate -fcoverage-mapping -DGGML_BACKEND_DL -DGGML_BACKEND_BUILD
                  -DGGML_BACKEND_SHARED -DGGML_SHARED -DGGML_BUILD -D_POSIX_C_SOURCE=200809L "-I$ROOT/ggml-backend/include"
                  "-I$ROOT/ggml-backend/src" "-I$ggml/include" "-I$ggml/src")
    local dir="$OUT/coverage/$target" objs=() paths=()
    rm -rf "$dir"
    mkdir -p "$dir"
    for f in $srcs; do
        "$CC" "${cflags[@]}" -fsanitize=fuzzer-no-link -c "ggml-backend/src/$f" -o "$dir/${f//\//_}.o"
        objs+=("$dir/${f//\//_}.o")
        paths+=("$ROOT/ggml-backend/src/$f")
    done
    "$CC" "${cflags[@]}" -D_GNU_SOURCE -fsanitize=fuzzer "$FUZZ_SRC/fuzz_$target.c" "${objs[@]}" -o "$dir/cov_$target" \
        -L"$lib" -l:libggml-base.so.0 -Wl,-rpath,"$lib" -lpthread -lm
    seeds
    local inputs=()
    for f in "$OUT/corpus/$target" "$OUT/seeds/$target" "tests/fuzz_regressions/$target"; do
        [ -d "$f" ] && inputs+=("$f")
    done
    LLVM_PROFILE_FILE="$dir/cov.profraw" "$dir/cov_$target" -runs=0 "${inputs[@]}" >"$dir/run.log" 2>&1 ||
        { tail -20 "$dir/run.log"; die "the coverage run failed"; }
    "$profdata" merge -o "$dir/cov.profdata" "$dir/cov.profraw"
    "$cov" report "$dir/cov_$target" -instr-profile="$dir/cov.profdata" "${paths[@]}"
    echo "fuzz.sh: lines never run: $cov show $dir/cov_$target -instr-profile=$dir/cov.profdata ${paths[*]} | grep -E '^ +[0-9]+\| +0\|'"
}

corpus="" use_seeds=1 runs=""
while [ $# -gt 0 ]; do
    case "$1" in
        --list) printf '%s\n' "${TARGETS[@]}"; exit 0 ;;
        --corpus) corpus="$2"; shift 2 ;;
        --no-seeds) use_seeds=0; shift ;;
        --runs) runs="$2"; shift 2 ;;
        --build) [ $# -eq 2 ] || usage; build "$2"; exit 0 ;;
        --coverage) [ $# -eq 2 ] || usage; coverage "$2"; exit 0 ;;
        --replay)
            [ $# -ge 3 ] || usage
            target="$2"; shift 2
            bin="$(build "$target")"
            inputs=()
            for p in "$@"; do
                if [ -d "$p" ]; then
                    while IFS= read -r f; do inputs+=("$f"); done < <(find "$p" -type f | sort)
                else
                    inputs+=("$p")
                fi
            done
            [ ${#inputs[@]} -gt 0 ] || { echo "fuzz.sh: no inputs to replay"; exit 0; }
            export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
            if "$bin" -rss_limit_mb=2048 -timeout=20 "${inputs[@]}"; then
                echo "fuzz.sh: $target: ${#inputs[@]} inputs replayed, no failure"
                exit 0
            fi
            echo "fuzz.sh: $target: an input failed (above)"
            exit 1 ;;
        -h|--help) usage ;;
        -*) die "unknown option $1" ;;
        *) break ;;
    esac
done
[ $# -ge 2 ] || usage
target="$1" minutes="$2"
shift 2
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --corpus) corpus="$2"; shift 2 ;;
        --no-seeds) use_seeds=0; shift ;;
        *) die "unknown argument $1" ;;
    esac
done
sources "$target" >/dev/null
seconds="$(awk -v m="$minutes" 'BEGIN { s = int(m * 60 + 0.5); if (s < 1) s = 1; print s }')"
bin="$(build "$target")"
dirs=()
corpus="${corpus:-$OUT/corpus/$target}"
mkdir -p "$corpus" "$OUT/artifacts/$target" "$OUT/logs"
dirs+=("$corpus")
if [ "$use_seeds" = 1 ]; then
    seeds
    dirs+=("$OUT/seeds/$target")
fi
log="$OUT/logs/$target-$(date +%Y%m%d-%H%M%S).log"
args=(-max_total_time="$seconds" -max_len="$(max_len "$target")" -timeout=20 -rss_limit_mb=2048 -malloc_limit_mb=2048
      -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$target/")
[ "$target" = config ] || args+=(-dict="$FUZZ_SRC/gguf.dict")
[ "$target" != config ] || args+=(-dict="$FUZZ_SRC/config.dict")
[ -z "$runs" ] || args+=(-runs="$runs")
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
echo "fuzz.sh: $bin ${args[*]} ${dirs[*]}"
echo "fuzz.sh: log $log"
set +e
# progress on the terminal without libFuzzer's NEW/REDUCE lines (all of it in the log)
"$bin" "${args[@]}" "${dirs[@]}" 2>&1 | tee "$log" | grep --line-buffered -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE) '
status=${PIPESTATUS[0]}
set -e

execs="$(awk '/^stat::number_of_executed_units:/ {v = $2} END {print v}' "$log")"
rate="$(awk '/^stat::average_exec_per_sec:/ {v = $2} END {print v}' "$log")"
last="$(grep -E '^#[0-9]+' "$log" | grep 'cov:' | tail -1)"
cov="$(grep -o 'cov: [0-9]*' <<<"$last" | awk '{print $2}')"
ft="$(grep -o 'ft: [0-9]*' <<<"$last" | awk '{print $2}')"
corp="$(grep -o 'corp: [0-9]*/[0-9A-Za-z]*' <<<"$last" | awk '{print $2}')"
echo "fuzz.sh: $target: ${execs:-?} executions, ${rate:-?} exec/s, cov ${cov:-?}, ft ${ft:-?}, corpus ${corp:-?} (inputs/bytes), $seconds s limit${runs:+, $runs runs limit}"
problems="$(grep -E 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|SUMMARY: |fuzz harness:' "$log" || true)"
if [ "$status" -ne 0 ] || [ -n "$problems" ]; then
    [ -z "$problems" ] || echo "$problems"
    inputs="$(grep -o 'Test unit written to .*' "$log" | sed 's/Test unit written to //' || true)"
    echo "fuzz.sh: $target FAILED (exit $status)${inputs:+; input: $inputs}"
    [ -z "$inputs" ] || echo "fuzz.sh: reproduce: tools/fuzz.sh --replay $target $inputs"
    exit 1
fi
echo "fuzz.sh: $target: no crash, leak or sanitizer report"
