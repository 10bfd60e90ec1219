#!/usr/bin/env bash
# A long fuzzing campaign of one target (docs/reliability.md), under ASan and UBSan:
#   bash tests/fuzz/campaign.sh TARGET [libFuzzer flags...]
#   e.g. bash tests/fuzz/campaign.sh plan_fuzzer -runs=2000000
#        bash tests/fuzz/campaign.sh model_spec_fuzzer -max_total_time=3600
# TARGET is one of tests/fuzz/BUILD's pipec_fuzz_test names. The corpus lives in
# .fuzz/TARGET/corpus (git-ignored), seeded from examples/, tests/golden, the seed plans and
# tests/fuzz/seeds/NAME/ and regressions/NAME-* (NAME: TARGET without "_fuzzer"), and grows from
# campaign to campaign; a crash's input goes to .fuzz/TARGET/ and fails the script.
# Last, the whole corpus is replayed once to print its coverage: inputs, edges (cov) and
# features (ft).
set -euo pipefail
cd "$(dirname "$0")/../.."
target=${1:?usage: campaign.sh TARGET [libFuzzer flags...]}
shift
# pipec compiles the seed plans of the plan targets; the others need only their own binary.
case "$target" in
  plan_fuzzer | piperun_intake_fuzzer) tools=//tools:pipec ;;
  *) tools= ;;
esac
bazel build --config=asan "//tests/fuzz:${target}_bin" $tools >&2
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
esac
short=${target%_fuzzer}
for seed in tests/fuzz/seeds/"$short"/* tests/fuzz/regressions/"$short"-*; do
  if [ -f "$seed" ]; then cp "$seed" "$work/seeds/"; fi
done
if [ -z "$(ls -A "$work/seeds")" ]; then
  echo "campaign.sh: no seeds for $target (tests/fuzz/seeds/$short/ is empty)" >&2
  exit 2
fi
"$bin" -dict=tests/fuzz/pipec.dict -timeout=20 -rss_limit_mb=2560 -print_final_stats=1 \
  -artifact_prefix="$work/" "$@" "$work/corpus" "$work/seeds"
echo "campaign.sh: corpus coverage of $target:" >&2
"$bin" -runs=0 -rss_limit_mb=2560 "$work/corpus" 2>&1 | grep -E "INITED|DONE" | tail -1
