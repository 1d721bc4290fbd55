#!/usr/bin/env bash
# Fuzzes each target in turn for SECONDS seconds on one core, then prints a table of executions,
# findings (crash/timeout/oom inputs libFuzzer saved) and corpus size per target.
#
#   fuzz/run-all.sh 600                     # every target, 10 minutes each
#   fuzz/run-all.sh 60 gguf artifact        # just these, 1 minute each
#
# libFuzzer runs in fork mode with one job, so it keeps going after a crash, timeout or
# out-of-memory and saves each finding under fuzz/artifacts/TARGET/. The working corpus grows in
# fuzz/corpus/TARGET (not committed), seeded from fuzz/seeds/TARGET and fuzz/regressions/TARGET.
# Limits: 10 s per input, 2 GB RSS, inputs up to 256 KiB. Logs go to fuzz/logs/TARGET.log.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:?usage: run-all.sh SECONDS [TARGET...]}
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(gguf_structured artifact checkpoint_dir target_toml safetensors_header ir_text gguf config_json)
fi
mkdir -p logs
# Build once, then run the binaries: editing the sources during a long run does not rebuild them.
# -a: debug assertions and overflow checks, so an arithmetic overflow is a finding too.
[ -n "${NO_BUILD:-}" ] || cargo +nightly fuzz build -O -a
bin=target/$(rustc +nightly -vV | sed -n 's/^host: //p')/release
results=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "seeds/$t" "regressions/$t" "artifacts/$t"
    before=$(find "artifacts/$t" -type f | wc -l)
    start=$(date +%s)
    "$bin/$t" "corpus/$t" "seeds/$t" "regressions/$t" \
        -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=262144 \
        -artifact_prefix="artifacts/$t/" >"logs/$t.log" 2>&1 || true
    elapsed=$(( $(date +%s) - start ))
    # Fork mode's progress lines: "#EXECS: cov: .. corp: N .. oom/timeout/crash: O/T/C time: ..".
    last=$(grep -E '^#[0-9]+: cov' "logs/$t.log" | tail -1 || true)
    execs=$(sed -E 's/^#([0-9]+):.*/\1/' <<<"$last")
    found=$(( $(find "artifacts/$t" -type f | wc -l) - before ))
    corpus=$(find "corpus/$t" -type f | wc -l)
    results+=("$(printf '%-20s %12s %8ss %9s %8s' "$t" "${execs:-?}" "$elapsed" "$found" "$corpus")")
done
printf '%-20s %12s %9s %9s %8s\n' target executions time findings corpus
printf '%s\n' "${results[@]}"
