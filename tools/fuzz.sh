#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer) of the .cellm reader and the model loader, on stable Rust.
#
#   bash tools/fuzz.sh [--seconds S | --runs N] [--jobs J] [--no-fixtures] [TARGET...]
#
# Targets (fuzz/fuzz_targets/): cellm_file (any bytes as a .cellm file: reader, loader, a few
# engine steps) and model_description (any JSON as a model description, with made-up weights
# that match it). Default: both, 60 seconds each. `--runs N` runs N executions per target
# instead; `--jobs J` runs J processes per target (executions add up).
#
# No nightly toolchain and no cargo-fuzz needed: the targets are built with the sanitizer
# coverage passes that cargo-fuzz would ask for (stable -C flags), and with AddressSanitizer
# through RUSTC_BOOTSTRAP=1 (-Zsanitizer=address; CELLM_FUZZ_ASAN=0 leaves it out). With a
# nightly toolchain, `cargo fuzz run TARGET` in fuzz/ works too.
#
# Corpora grow in target/fuzz/corpus/TARGET, seeded by the cellm-engine example fuzz_seeds:
# made-up files of every text family, and the test fixtures (tests/fixtures/hf-tiny, and the
# vision-language ones in tests/fixtures/mm) converted with `python -m cellm.convert`
# (f16, and llama also q4_k and q8_0) when the cellm package imports and --no-fixtures is not
# given (tools/test.sh gives it: converting takes longer than its run). Findings go to
# target/fuzz/artifacts/TARGET/; the script fails if any target finds one.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60
runs=""
jobs=1
fixtures_wanted=1
targets=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        --no-fixtures) fixtures_wanted=0; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) targets+=("$1"); shift ;;
    esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=(cellm_file model_description)

work="target/fuzz"
host="$(rustc -vV | sed -n 's/^host: //p')"
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
flags+=" -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"
flags+=" --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
if [[ "${CELLM_FUZZ_ASAN:-1}" != 0 ]]; then
    flags+=" -Zsanitizer=address"
    export RUSTC_BOOTSTRAP=1
fi
# --target keeps these flags off build scripts and proc macros, as cargo-fuzz does. Not
# --locked: fuzz/Cargo.lock pins what it lists, and takes in a dependency a crate gains.
RUSTFLAGS="$flags" CARGO_TARGET_DIR="$work/build" \
    cargo build --release --manifest-path fuzz/Cargo.toml --target "$host" --bins
bin="$work/build/$host/release"

# Seeds: made-up files of every family, and the fixtures converted (once).
seeds="$work/seeds"
fixtures=()
if [[ "$fixtures_wanted" == 0 ]]; then
    :
elif python3 -c "import cellm._core" >/dev/null 2>&1; then
    mkdir -p "$work/fixtures"
    for dir in tests/fixtures/hf-tiny/*/ tests/fixtures/mm/*/; do
        name="$(basename "$dir")"
        variants=("f16:")
        [[ "$name" == llama ]] && variants+=("q4_k:--quantize q4_k" "q8_0:--quantize q8_0")
        for v in "${variants[@]}"; do
            out="$work/fixtures/$name-${v%%:*}.cellm"
            if [[ ! -f "$out" ]]; then
                # shellcheck disable=SC2086
                python3 -m cellm.convert --input "$dir" --output "$out" --dtype f16 ${v#*:} \
                    >/dev/null
            fi
            fixtures+=("$out")
        done
    done
else
    echo "fuzz: the cellm package does not import; seeding with made-up files only"
fi
cargo run --quiet --locked -p cellm-engine --example fuzz_seeds -- "$seeds" "${fixtures[@]}"

status=0
for t in "${targets[@]}"; do
    corpus="$work/corpus/$t"
    artifacts="$work/artifacts/$t/"
    mkdir -p "$corpus" "$artifacts"
    budget=(-max_total_time="$seconds")
    [[ -n "$runs" ]] && budget=(-runs="$((runs / jobs))")
    max_len=1048576
    extra=()
    [[ "$t" == model_description ]] && max_len=65536 && extra=(-dict=fuzz/json.dict)
    args=("$corpus" "$seeds/$t" -artifact_prefix="$artifacts" -max_len="$max_len" -timeout=20
        -rss_limit_mb=4096 -print_final_stats=1 "${budget[@]}" "${extra[@]}")
    log="$work/$t.log"
    echo "fuzz: $t (${runs:-$seconds s}${runs:+ runs}, $jobs job(s)), log in $log"
    if [[ "$jobs" -gt 1 ]]; then
        # Each worker writes fuzz-N.log in the current folder: kept beside the log.
        "$bin/$t" "${args[@]}" -jobs="$jobs" -workers="$jobs" >"$log" 2>&1 || status=1
        for w in fuzz-*.log; do mv "$w" "$work/$t.$w"; done
        stats=("$work/$t".fuzz-*.log)
    else
        "$bin/$t" "${args[@]}" >"$log" 2>&1 || status=1
        stats=("$log")
    fi
    total="$(cat "${stats[@]}" | sed -n 's/^stat::number_of_executed_units: *//p' \
        | awk '{n += $1} END {print n + 0}')"
    echo "fuzz: $t: $total executions (the corpus's replay included)"
    if ls "$artifacts" | grep -q .; then
        echo "fuzz: $t found: $(ls "$artifacts")" >&2
        status=1
    fi
done
exit "$status"
