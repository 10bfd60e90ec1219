//===- NcclLayout.cpp - Who this process is and which communicators it makes -===//
#include "runtime/cuda/NcclLayout.h"

#include "ir/support/Error.h"

#include "llvm/ADT/StringRef.h"

#include <algorithm>
#include <cstdlib>

namespace pipec {

namespace {

/// An integer variable of the launcher; `unset` says who sets it, `bad` what it should be
/// (`unset` when empty).
llvm::Expected<int> intVar(const std::function<const char *(const char *)> &getenv,
                           const char *name, int min, int max, const std::string &unset,
                           const std::string &bad = "") {
  const char *v = getenv(name);
  if (!v || !*v)
    return inputError("--backend nccl: {} is not set; {}", name, unset);
  long long n = 0;
  if (llvm::StringRef(v).trim().getAsInteger(10, n) || n < min || n > max)
    return inputError("--backend nccl: {}={} is not an integer in [{}, {}]; {}", name, v, min, max,
                      bad.empty() ? unset : bad);
  return int(n);
}

bool isSet(const std::function<const char *(const char *)> &getenv, const char *name) {
  const char *v = getenv(name);
  return v && *v;
}

} // namespace

const std::vector<Launcher> &launchers() {
  static const std::vector<Launcher> all = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK", nullptr,
       [](int n) {
         return fmt::format("torchrun --nproc-per-node {} on one node, or --nnodes M "
                            "--nproc-per-node K with M x K = {}",
                            n, n);
       },
       [](int n) { return fmt::format("torchrun --nproc-per-node {}", n); },
       "NCCL_COMM_ID=$MASTER_ADDR:29600 torchrun ..."},
      {"Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", nullptr,
       [](int n) { return fmt::format("mpirun -np {}", n); },
       [](int n) { return fmt::format("mpirun --map-by ppr:{}:node", n); },
       "mpirun -x NCCL_COMM_ID=<host of rank 0>:29600 ... (Open MPI passes only -x variables to "
       "other nodes)"},
      {"MVAPICH2's mpirun_rsh", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
       "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_RANK", nullptr,
       [](int n) { return fmt::format("mpirun_rsh -np {}", n); },
       [](int n) { return fmt::format("a hostfile with {} slots a node", n); },
       "mpirun_rsh -np N -hostfile F NCCL_COMM_ID=<host of rank 0>:29600 piperun ..."},
      // Hydra's MPI_LOCALRANKID is the marker: srun's PMI2 plugin sets PMI_RANK too.
      {"MPICH's or Intel MPI's mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
       "MPI_LOCALRANKID",
       "this process was not started by MPICH's or Intel MPI's mpiexec, which set both (another "
       "launcher's PMI does not say which GPU is the process's): set RANK, WORLD_SIZE and "
       "LOCAL_RANK from your launcher's variables",
       [](int n) { return fmt::format("mpiexec -n {}", n); },
       [](int n) { return fmt::format("mpiexec -ppn {}", n); },
       "mpiexec -genv NCCL_COMM_ID <host of rank 0>:29600 ..."},
      // (srun sets SLURM_STEP_ID and SLURM_STEP_NUM_TASKS in every task of a step; an
      // interactive step, srun --pty or salloc's, is a step of one task.)
      {"srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_ID",
       // An sbatch script's shell has SLURM_PROCID=0 and the job's SLURM_NTASKS, but it is one
       // process: taken for rank 0, it would wait for processes that never start.
       "this is a Slurm job's batch script, not a task that srun started, so start piperun "
       "with srun --ntasks {}",
       [](int n) { return fmt::format("srun --ntasks {}", n); },
       [](int n) { return fmt::format("srun --ntasks-per-node {}", n); },
       "NCCL_COMM_ID=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1):29600 srun "
       "..."}};
  return all;
}

std::string LaunchEnv::describe() const {
  return fmt::format("{}={} {}={} {}={}", launcher->rankVar, rank, launcher->sizeVar, worldSize,
                     launcher->localRankVar, localRank);
}

llvm::Expected<LaunchEnv> launchEnvOf(const Plan &plan,
                                      const std::function<const char *(const char *)> &getenv) {
  const ParallelConfig &pc = plan.parallel;
  const int need = pc.pp * pc.dp * pc.tp;
  const std::vector<Launcher> &all = launchers();
  auto found = std::find_if(all.begin(), all.end(),
                            [&](const Launcher &l) { return isSet(getenv, l.marker); });
  if (found == all.end()) {
    std::string others;
    for (auto it = all.begin() + 1; it != all.end(); ++it)
      others +=
          fmt::format("; {}: {}, {}, {}", it->name, it->rankVar, it->sizeVar, it->localRankVar);
    // A launcher's rank variable without its marker: say what this process is instead.
    std::string notLaunched;
    for (const Launcher &l : all)
      if (l.withoutMarker && isSet(getenv, l.rankVar))
        notLaunched += fmt::format("{} is set but {} is not: {}; or ", l.rankVar, l.marker,
                                   fmt::format(fmt::runtime(l.withoutMarker), need));
    // (RANK, torchrun's marker, is not set, or another's would have been found.)
    return inputError("--backend nccl: RANK is not set; {}run one process per GPU under a "
                      "launcher that sets its variables (torchrun: RANK, WORLD_SIZE, LOCAL_RANK{}, "
                      "inside a job step), or for one process: RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 "
                      "(this plan needs WORLD_SIZE={})",
                      notLaunched, others, need);
  }
  const Launcher &l = *found;
  const std::string how =
      fmt::format("{} sets {}, {} and {} in every process it starts (this plan needs {}={}: {})",
                  l.name, l.rankVar, l.sizeVar, l.localRankVar, l.sizeVar, need, l.total(need));
  auto world = intVar(getenv, l.sizeVar, 1, 1 << 20, how);
  if (!world)
    return world.takeError();
  if (*world != need)
    return inputError("--backend nccl: {}={} but the plan needs pp {} x dp {} x tp {} = {} "
                      "processes; launch {} (e.g. {})",
                      l.sizeVar, *world, pc.pp, pc.dp, pc.tp, need, need, l.total(need));
  auto rank =
      intVar(getenv, l.rankVar, 0, need - 1, how,
             fmt::format("{} must be this process's global rank, 0..{}", l.rankVar, need - 1));
  if (!rank)
    return rank.takeError();
  auto local = intVar(getenv, l.localRankVar, 0, *rank, how,
                      fmt::format("{} is this process's GPU on its node, 0..{} (at most {}={})",
                                  l.localRankVar, need - 1, l.rankVar, *rank));
  if (!local)
    return local.takeError();
  LaunchEnv env;
  env.worldSize = *world;
  env.rank = *rank;
  env.localRank = *local;
  env.launcher = &l;
  env.coord = Coord{*rank / (pc.dp * pc.tp), *rank / pc.tp % pc.dp, *rank % pc.tp};
  if (const char *id = getenv("NCCL_HOSTID"))
    env.hostId = id;
  auto param = [&getenv](const char *name, long fallback) {
    const char *v = getenv(name);
    return v && *v ? std::strtol(v, nullptr, 10) : fallback;
  };
  const long retries = param("NCCL_SOCKET_RETRY_CNT", 34);
  env.rootRetrySeconds = 0.001 * double(param("NCCL_SOCKET_RETRY_SLEEP_MSEC", 100)) *
                         double(retries * (retries + 1) / 2);
  if (const char *id = getenv("NCCL_COMM_ID"); id && *id) {
    auto [host, port] = llvm::StringRef(id).rsplit(':');
    unsigned p = 0;
    if (host.empty() || port.getAsInteger(10, p) || p == 0 || p > 65535)
      return inputError("--backend nccl: NCCL_COMM_ID={} is not host:port; set it to RANK 0's "
                        "address and a free port, e.g. NCCL_COMM_ID=node0:29600",
                        id);
    env.commId = id;
  } else if (*world > 1) {
    return inputError("--backend nccl: NCCL_COMM_ID is not set; with {}={} > 1 NCCL bootstraps "
                      "through it: set NCCL_COMM_ID=<host of rank 0>:<free port> on every "
                      "process, e.g. {}",
                      l.sizeVar, *world, l.commIdHint);
  }
  return env;
}

const char *toString(CommKind k) {
  switch (k) {
  case CommKind::World:
    return "world";
  case CommKind::Pipeline:
    return "pipeline";
  case CommKind::Tp:
    return "tp";
  case CommKind::Dp:
    return "dp";
  case CommKind::Embedding:
    return "embedding";
  }
  return "?";
}

llvm::Error sharedGpuError(const std::string &ncclLastError, const LaunchEnv &env, int visibleGpus,
                           const char *hostId) {
  const llvm::StringRef kDuplicate = "Duplicate GPU detected";
  llvm::StringRef last(ncclLastError);
  size_t at = last.find(kDuplicate);
  if (at == llvm::StringRef::npos)
    return llvm::Error::success();
  // NCCL's words: "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx".
  std::string who = "two processes";
  llvm::StringRef rest = last.drop_front(at + kDuplicate.size()).ltrim(" :");
  unsigned a = 0, b = 0;
  if (rest.consume_front("rank ") && !rest.consumeInteger(10, a) &&
      rest.consume_front(" and rank ") && !rest.consumeInteger(10, b))
    who = fmt::format("RANK {} and RANK {}", a, b);
  std::string fix =
      hostId ? fmt::format("give each a different NCCL_HOSTID (this one's, {}, is another's too)",
                           hostId)
             : std::string("give each its own NCCL_HOSTID");
  return inputError("--backend nccl: {} share one GPU (this process, {}={}, sees {} GPU{}), and "
                    "NCCL allows one process per GPU: start at most one process per GPU of a "
                    "node ({}), or, to test several processes on one GPU, {} (NCCL then treats "
                    "each as a node and moves data over sockets, NCCL_SOCKET_IFNAME=lo; slow, for "
                    "tests only)",
                    who, env.launcher->localRankVar, env.localRank, visibleGpus,
                    visibleGpus == 1 ? "" : "s", env.launcher->perNode(std::max(visibleGpus, 1)),
                    fix);
}

std::vector<CommSpec> commLayout(const Plan &plan, int rank) {
  const ParallelConfig &pc = plan.parallel;
  const Coord c{rank / (pc.dp * pc.tp), rank / pc.tp % pc.dp, rank % pc.tp};
  std::vector<CommSpec> out;
  out.push_back(CommSpec{CommKind::World, 0, rank, pc.pp * pc.dp * pc.tp});
  // One pipeline per (dp, tp) replica; its rank is the pipeline rank, so a plan's `peer` is the
  // peer's rank in it. At pp = 2 prev and next are the same process: the plan's sends and recvs
  // of that pair are FIFO-matched in plan order (verified), which is NCCL's matching rule.
  if (pc.pp > 1)
    out.push_back(CommSpec{CommKind::Pipeline, c.dp * pc.tp + c.tp, c.pp, pc.pp});
  // tp: the tp ranks of one pipeline rank and replica, key = tp rank (the interpreter's member
  // order).
  if (pc.tp > 1)
    out.push_back(CommSpec{CommKind::Tp, c.pp * pc.dp + c.dp, c.tp, pc.tp});
  // dp: the replicas of one pipeline rank and tp rank, key = replica.
  if (pc.dp > 1)
    out.push_back(CommSpec{CommKind::Dp, c.pp * pc.tp + c.tp, c.dp, pc.dp});
  // embedding: first stage's rank (key 0) and last stage's rank (key 1) of one (dp, tp).
  if (plan.tiedEmbeddings()) {
    int first = plan.rankOf(0), last = plan.rankOf(plan.numStages() - 1);
    if (first != last) {
      bool member = c.pp == first || c.pp == last;
      out.push_back(CommSpec{CommKind::Embedding, member ? c.dp * pc.tp + c.tp : -1,
                             c.pp == first ? 0 : 1, member ? 2 : 0});
    }
  }
  return out;
}

int worldRankOf(const Plan &plan, const Coord &c) {
  return (c.pp * plan.parallel.dp + c.dp) * plan.parallel.tp + c.tp;
}

std::vector<GradientShard> gradientShards(const Plan &plan,
                                          const std::function<size_t(int)> &layerFloats) {
  std::vector<GradientShard> shards;
  for (int r = 0; r < plan.numRanks(); ++r)
    for (int t = 0; t < plan.parallel.tp; ++t) {
      int rank = worldRankOf(plan, Coord{r, 0, t});
      if (rank == 0)
        continue;
      for (const StageInfo &s : plan.stages) {
        if (s.rank != r)
          continue;
        GradientShard g{rank, s.stage, t, 0};
        for (int l = s.layerBegin; l < s.layerEnd; ++l)
          g.floats += layerFloats(l);
        shards.push_back(g);
      }
    }
  return shards;
}

std::vector<std::vector<GatherOp>> gatherGroups(const std::vector<GradientShard> &shards,
                                                int rank) {
  std::vector<std::vector<GatherOp>> groups;
  for (size_t k = 0; k < shards.size();) {
    const int from = shards[k].rank;
    std::vector<GatherOp> group;
    for (; k < shards.size() && shards[k].rank == from; ++k)
      if (rank == from)
        group.push_back(GatherOp{true, 0, shards[k]});
      else if (rank == 0)
        group.push_back(GatherOp{false, from, shards[k]});
    if (!group.empty())
      groups.push_back(std::move(group));
  }
  return groups;
}

} // namespace pipec
