//===- nccl_overhead_bench.cpp - Host cost per instruction of the nccl mode's runtime -===//
//
// cuda_overhead_bench for the nccl mode (runtime/cuda/NcclRun.h): one rank of a compiled plan
// (--pp stages of unit layers, --schedule, --microbatches) per process, launched as piperun
// --backend nccl is (RANK, WORLD_SIZE, LOCAL_RANK, NCCL_COMM_ID), runs through the shared
// interpreter and the nccl transport (runtime/cuda/NcclTransport.h: a p2p stream, events, one
// NCCL group per plan group, the watchdog's markers, the record of sends that compute does not
// wait for) with a backend whose compute ops queue nothing and whose sends and recvs move
// --floats floats each. Each process prints one line:
// the host time of its best step (the interpreter posting the step; nothing in a step waits for
// the device) per instruction of its stream, against the target of at most 10 us; then the
// step time with the device (to the end of waitStep: NCCL's transfers and the GPU's
// launches), the instructions and the p2p ops. Unlike cuda_overhead_bench's ranks on one GPU,
// no two ranks share a process here, so this is the cost a rank pays on a cluster.
//   torchrun --nproc-per-node 4 bazel-bin/bench/nccl_overhead_bench --pp 4 --microbatches 1024
// --threads runs every rank as a thread of this process instead (LOCAL_RANK = the rank): on
// the emulated device with the emulated NCCL, which is how CI runs it (it checks the bench
// runs, not the cost), or on a machine with one GPU per rank.
// Needs a GPU; not a test: the numbers go into the README (tools/gpu_check.sh runs it).
//
//===----------------------------------------------------------------------===//
#include "bench/OverheadBench.h"
#include "bench/UniformPlan.h"
#include "ir/support/Error.h"
#include "runtime/Interpreter.h"
#include "runtime/cuda/Nccl.h"
#include "runtime/cuda/NcclLayout.h"
#include "runtime/cuda/NcclRun.h"
#include "runtime/cuda/NcclTransport.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <thread>
#include <utility>
#include <vector>

using namespace pipec;

namespace {

/// The rank's backend: its optimizer step waits for the transport's collectives.
class NcclEmptyBackend final : public bench::EmptyDeviceBackend {
public:
  NcclEmptyBackend(NcclTransport &transport, int device) : transport(transport), device(device) {}
  llvm::Error beginStep(int) override { return setDevice(device); }
  llvm::Error optimizerStep() override { return transport.waitForCollectives(); }

private:
  NcclTransport &transport;
  int device;
};

/// Runs `settings.steps` steps (after one to warm up) of `env`'s rank on GPU `device`; its
/// report line.
llvm::Expected<std::string> runRank(const Plan &plan, const LaunchEnv &env, int device,
                                    const bench::OverheadFlags &settings) {
  PIPEC_CUDA_TRY(cudaSetDevice(device));
  auto comms = createCommunicators(plan, env);
  if (!comms)
    return comms.takeError();
  NcclTransport transport(plan, env, **comms);
  NcclEmptyBackend backend(transport, device);
  // (5 floats more for warmUp to send, receive and sum.)
  if (auto err = backend.init(size_t(settings.floats), 5))
    return err;
  // The runtime's SendHold records the sends the compute stream does not wait for (its arena,
  // runtime/cuda/DeviceArena.h); the backend here never releases its buffers, so the list is
  // only kept, as the arena keeps it.
  std::vector<std::pair<const void *, size_t>> reads;
  reads.reserve(plan.ranks[size_t(env.coord.pp)].size());
  NcclTransport::SendHold hold{
      [&reads](const void *data, size_t bytes, cudaEvent_t) { reads.emplace_back(data, bytes); },
      [&reads] { reads.clear(); }};
  if (auto err = transport.init(
          backend.computeStream(), [] { return llvm::Error::success(); }, std::move(hold)))
    return err;
  if (auto err =
          transport.warmUp(backend.extraFloats(), /*timeoutSeconds=*/30, peerArrivalLimit(30)))
    return err;
  RunShared shared(plan, Faults{}, transport);
  const auto &stream = plan.ranks[size_t(env.coord.pp)];
  size_t p2pOps = 0;
  for (const Instruction &i : stream)
    p2pOps += i.isP2P() ? 1 : 0;
  using Clock = std::chrono::steady_clock;
  double bestHost = 1e300, bestTotal = 1e300;
  for (int64_t s = 0; s <= settings.steps; ++s) { // step 0 warms up
    transport.beginStep();
    if (auto err = backend.beginStep(int(s))) {
      (*comms)->abortAll();
      return err;
    }
    auto start = Clock::now();
    if (auto err = interpretStep(shared, env.coord, backend)) {
      (*comms)->abortAll(); // the peers fail instead of waiting for this rank
      return err;
    }
    const double host = std::chrono::duration<double>(Clock::now() - start).count();
    if (auto err = transport.waitStep(int(s), /*timeoutSeconds=*/30))
      return err;
    const double total = std::chrono::duration<double>(Clock::now() - start).count();
    if (s > 0) {
      bestHost = std::min(bestHost, host);
      bestTotal = std::min(bestTotal, total);
    }
  }
  return fmt::format("rank={} schedule={} pp={} microbatches={} floats={} stream={} "
                     "host_step={:.4f}s host_per_instruction={:.2f}us step_with_device={:.4f}s "
                     "p2p_ops={}",
                     env.rank, settings.schedule, settings.pp, settings.microbatches,
                     settings.floats, stream.size(), bestHost,
                     bestHost / double(stream.size()) * 1e6, bestTotal, p2pOps);
}

int fail(llvm::Error err, int code = -1) {
  return bench::fail("nccl_overhead_bench", std::move(err), code);
}

/// The GPU of a process: LOCAL_RANK, or the one GPU it sees (CUDA_VISIBLE_DEVICES set per
/// process, as srun may), as the nccl mode chooses (runtime/cuda/NcclRun.cpp).
llvm::Expected<int> deviceOf(const LaunchEnv &env, int devices) {
  if (env.localRank < devices)
    return env.localRank;
  if (devices == 1)
    return 0;
  return inputError("LOCAL_RANK={} but this process sees {} GPUs; launch at most {} processes "
                    "per node",
                    env.localRank, devices, devices);
}

/// The launch variables of rank `r` of `pp` when every rank is a thread (--threads).
llvm::Expected<LaunchEnv> threadEnv(const Plan &plan, int r, int64_t pp,
                                    const std::string &commId) {
  std::map<std::string, std::string> vars{{"RANK", std::to_string(r)},
                                          {"WORLD_SIZE", std::to_string(pp)},
                                          {"LOCAL_RANK", std::to_string(r)},
                                          {"NCCL_COMM_ID", commId}};
  return launchEnvOf(plan, [&](const char *name) -> const char * {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

} // namespace

int main(int argc, char **argv) {
  auto flags = bench::parseOverheadFlags(argc, argv, {"--threads"}, 2);
  if (!flags)
    return fail(flags.takeError());
  const int64_t pp = flags->pp;
  const bool asThreads = flags->args.has("--threads");
  // Before the first CUDA or NCCL call (these may set environment variables): with every rank a
  // thread, the bootstrap id comes from NCCL_COMM_ID, as in a launch.
  const std::string ncclLine = prepareNcclEnvironment(
      ::getenv, [](const char *name, const char *value) { (void)::setenv(name, value, 0); });
  if (asThreads)
    (void)::setenv("NCCL_COMM_ID", "127.0.0.1:29517", /*overwrite=*/0);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fmt::print(stderr, "nccl_overhead_bench: no usable CUDA device\n");
    return 2;
  }
  auto plan = bench::compileUniformPlan(int(pp), int(flags->microbatches), flags->schedule);
  if (!plan)
    return fail(plan.takeError());

  if (!asThreads) { // one rank: this process's
    auto env = launchEnvOf(*plan, ::getenv);
    if (!env)
      return fail(env.takeError());
    auto device = deviceOf(*env, devices);
    if (!device)
      return fail(device.takeError());
    if (env->rank == 0)
      fmt::print("{}\n", ncclLine);
    auto line = runRank(*plan, *env, *device, *flags);
    if (!line)
      return fail(line.takeError(), 1);
    fmt::print("{}\n", *line);
    return 0;
  }

  // Every rank a thread.
  const std::string commId = std::getenv("NCCL_COMM_ID");
  // The variables are the same but for the rank: a problem with them (NCCL_COMM_ID's form) is
  // reported once, before any thread starts.
  if (auto env = threadEnv(*plan, 0, pp, commId); !env)
    return fail(env.takeError());
  fmt::print("{}\n", ncclLine);
  std::vector<llvm::Expected<std::string>> lines;
  for (int r = 0; r < int(pp); ++r)
    lines.emplace_back(std::string());
  std::vector<std::thread> threads;
  for (int r = 0; r < int(pp); ++r)
    threads.emplace_back([&, r] {
      auto env = threadEnv(*plan, r, pp, commId);
      if (!env) {
        lines[size_t(r)] = env.takeError();
        return;
      }
      lines[size_t(r)] = runRank(*plan, *env, r % devices, *flags);
    });
  for (auto &t : threads)
    t.join();
  int code = 0;
  for (auto &line : lines) {
    if (!line) {
      code = fail(line.takeError(), 1);
      continue;
    }
    fmt::print("{}\n", *line);
  }
  return code;
}
