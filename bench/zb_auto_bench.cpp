//===- zb_auto_bench.cpp - How long zb-auto's search takes ----------------===//
//
// Times the zb-auto policy's search alone (emit(): the greedy variants and the local search)
// on the zero-bubble paper's largest setting, its 28.3B model at p = 32, m = 256 (Table 9
// costs: T_F 10.402, T_B 10.248, T_W 7.698, T_comm 0.460; M_W = M_B/2), at --memory-limit
// p·M_B and 2p·M_B, then compiles the whole plan once to print its bubble
// (docs/contracts.md#semantics). The authors' Python heuristic takes about 1.2 s here; the target
// is a tenth of that.
//   bazel run -c opt //bench:zb_auto_bench [-- --pp 32 --microbatches 256 --repeat 5]
// Not a test: the numbers go into the README.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "ir/support/Error.h"
#include "schedules/Policy.h"
#include "tools/Args.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <vector>

using namespace pipec;

int main(int argc, char **argv) {
  auto args =
      Args::parse(argc, argv, 1, {"--pp", "--microbatches", "--repeat"}, {}, /*command=*/"");
  if (!args) {
    fmt::print(stderr, "zb_auto_bench: {}\n", takeMessage(args.takeError()));
    return 2;
  }
  auto pp = args->integer("--pp", 32, 1, 4096);
  auto m = args->integer("--microbatches", 256, 1, 1 << 20);
  auto repeat = args->integer("--repeat", 5, 1, 100);
  if (!pp || !m || !repeat) {
    llvm::Error err = !pp ? pp.takeError() : !m ? m.takeError() : repeat.takeError();
    fmt::print(stderr, "zb_auto_bench: {}\n", takeMessage(std::move(err)));
    return 2;
  }
  const int64_t mb = int64_t(1) << 30; // M_B per stage
  ModelSpec model;
  model.name = "zb-28.3b";
  Layer l;
  l.name = "stage";
  l.forward = 10.402;
  l.backwardInput = 10.248;
  l.backwardWeight = 7.698;
  l.activationBytes = mb;
  l.weightGradBytes = mb / 2;
  l.outputBytes = 1 << 24;
  l.paramBytes = 1 << 28;
  model.layers.assign(size_t(*pp), l);
  model.p2pTime = 0.460;

  auto policy = findPolicy("zb-auto");
  if (!policy) {
    fmt::print(stderr, "zb_auto_bench: {}\n", takeMessage(policy.takeError()));
    return 2;
  }
  for (int k = 1; k <= 2; ++k) {
    CompileOptions o;
    o.schedule = "zb-auto";
    o.parallel.pp = int(*pp);
    o.parallel.microbatches = int(*m);
    o.memoryLimit = k * int64_t(*pp) * mb;
    auto plan = compilePlan(model, ClusterSpec::defaults(), o);
    if (!plan) {
      fmt::print(stderr, "zb_auto_bench: {}\n", takeMessage(plan.takeError()));
      return 1;
    }
    // The search alone, on the partitioned stages of that plan.
    ScheduleRequest req;
    req.parallel = plan->parallel;
    req.stages = plan->stages;
    req.memoryLimit = o.memoryLimit;
    std::vector<double> ms;
    for (int64_t i = 0; i < *repeat; ++i) {
      ComputeOrder order;
      auto t0 = std::chrono::steady_clock::now();
      (*policy)->emit(req, order);
      auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    fmt::print("zb-auto p={} m={} limit {}p·M_B: search {:.1f} ms (median of {}, min {:.1f}), "
               "bubble {:.4f}, makespan {:.3f}\n",
               *pp, *m, k, ms[ms.size() / 2], ms.size(), ms.front(), plan->stats.bubbleRatio,
               plan->stats.makespan);
  }
  return 0;
}
