#!/usr/bin/env bash
# A long fuzzing campaign of one target (docs/reliability.md), under ASan and UBSan:
#   bash tests/fuzz/campaign.sh TARGET [libFuzzer flags...]
#   e.g. bash tests/fuzz/campaign.sh plan_fuzzer -runs=2000000
#        bash tests/fuzz/campaign.sh model_spec_fuzzer -max_total_time=3600
# TARGET is one of tests/fuzz's: model_spec_fuzzer cluster_spec_fuzzer plan_fuzzer
# plan_text_fuzzer torch_csv_fuzzer piperun_intake_fuzzer manifest_fuzzer. The corpus lives in
# .fuzz/TARGET/corpus (git-ignored), seeded from examples/, tests/golden and the seed plans, and
# grows from campaign to campaign; a crash's input goes to .fuzz/TARGET/ and fails the script.
# Last, the whole corpus is replayed once to print its coverage: inputs, edges (cov) and
# features (ft).
set -euo pipefail
cd "$(dirname "$0")/../.."
target=${1:?usage: campaign.sh TARGET [libFuzzer flags...]}
shift
bazel build --config=asan "//tests/fuzz:${target}_bin" //tools:pipec >&2
bin="$(bazel info --config=asan bazel-bin 2>/dev/null)/tests/fuzz/${target}_bin"
pipec="$(bazel info --config=asan bazel-bin 2>/dev/null)/tools/pipec"
work=.fuzz/$target
mkdir -p "$work/corpus" "$work/seeds"
case "$target" in
  model_spec_fuzzer | cluster_spec_fuzzer) cp examples/*.json "$work/seeds/" ;;
  plan_text_fuzzer) cp tests/golden/*.txt "$work/seeds/" ;;
  torch_csv_fuzzer) cp tests/golden/torch_*.csv tests/golden/*.txt "$work/seeds/" ;;
  manifest_fuzzer) cp tests/fuzz/seeds/manifest-*.json "$work/seeds/" ;;
  plan_fuzzer | piperun_intake_fuzzer)
    prefix=""
    [ "$target" = piperun_intake_fuzzer ] && prefix=tiny
    while read -r name flags; do
      case "$name" in '#'* | '') continue ;; "$prefix"*) ;; *) continue ;; esac
      # shellcheck disable=SC2086
      "$pipec" compile --quiet --model examples/$flags -o "$work/seeds/$name.json"
    done <tests/fuzz/seed_plans.txt
    ;;
  *) echo "campaign.sh: unknown target $target" >&2; exit 2 ;;
esac
"$bin" -dict=tests/fuzz/pipec.dict -timeout=20 -rss_limit_mb=2560 -print_final_stats=1 \
  -artifact_prefix="$work/" "$@" "$work/corpus" "$work/seeds"
echo "campaign.sh: corpus coverage of $target:" >&2
"$bin" -runs=0 -rss_limit_mb=2560 "$work/corpus" 2>&1 | grep -E "INITED|DONE" | tail -1
