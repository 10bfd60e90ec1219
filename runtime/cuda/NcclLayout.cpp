//===- NcclLayout.cpp - Who this process is and which communicators it makes -===//
#include "runtime/cuda/NcclLayout.h"

#include "ir/Error.h"

#include "llvm/ADT/StringRef.h"

#include <algorithm>

namespace pipec {

namespace {

/// An integer variable of the launcher; `what` says what it should be.
llvm::Expected<int> intVar(const std::function<const char *(const char *)> &getenv,
                           const char *name, int min, int max, const std::string &how) {
  const char *v = getenv(name);
  if (!v || !*v)
    return inputError("--backend nccl: {} is not set; {}", name, how);
  long long n = 0;
  if (llvm::StringRef(v).trim().getAsInteger(10, n) || n < min || n > max)
    return inputError("--backend nccl: {}={} is not an integer in [{}, {}]; {}", name, v, min, max,
                      how);
  return int(n);
}

} // namespace

llvm::Expected<LaunchEnv> launchEnvOf(const Plan &plan,
                                      const std::function<const char *(const char *)> &getenv) {
  const ParallelConfig &pc = plan.parallel;
  const int need = pc.pp * pc.dp * pc.tp;
  const std::string how = fmt::format(
      "run one process per GPU under a launcher that sets RANK, WORLD_SIZE and LOCAL_RANK "
      "(torchrun, srun), or for one process: RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 (this plan needs "
      "WORLD_SIZE={})",
      need);
  auto world = intVar(getenv, "WORLD_SIZE", 1, 1 << 20, how);
  if (!world)
    return world.takeError();
  if (*world != need)
    return inputError("--backend nccl: WORLD_SIZE={} but the plan needs pp {} x dp {} x tp {} = {} "
                      "processes; launch {} (e.g. torchrun --nproc-per-node {})",
                      *world, pc.pp, pc.dp, pc.tp, need, need, need);
  auto rank = intVar(getenv, "RANK", 0, need - 1,
                     fmt::format("RANK must be this process's global rank, 0..{}", need - 1));
  if (!rank)
    return rank.takeError();
  auto local = intVar(getenv, "LOCAL_RANK", 0, *rank,
                      fmt::format("LOCAL_RANK is this process's GPU on its node, 0..{} (at most "
                                  "RANK={})",
                                  need - 1, *rank));
  if (!local)
    return local.takeError();
  LaunchEnv env;
  env.worldSize = *world;
  env.rank = *rank;
  env.localRank = *local;
  env.coord = Coord{*rank / (pc.dp * pc.tp), *rank / pc.tp % pc.dp, *rank % pc.tp};
  if (const char *id = getenv("NCCL_COMM_ID"); id && *id) {
    auto [host, port] = llvm::StringRef(id).rsplit(':');
    unsigned p = 0;
    if (host.empty() || port.getAsInteger(10, p) || p == 0 || p > 65535)
      return inputError("--backend nccl: NCCL_COMM_ID={} is not host:port; set it to RANK 0's "
                        "address and a free port, e.g. NCCL_COMM_ID=node0:29600",
                        id);
    env.commId = id;
  } else if (*world > 1) {
    return inputError("--backend nccl: NCCL_COMM_ID is not set; with WORLD_SIZE={} > 1 NCCL "
                      "bootstraps through it: set NCCL_COMM_ID=<host of RANK 0>:<free port> on "
                      "every process, e.g. NCCL_COMM_ID=$MASTER_ADDR:29600",
                      *world);
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
  return inputError("--backend nccl: {} share one GPU (this process, LOCAL_RANK={}, sees {} "
                    "GPU{}), and NCCL allows one process per GPU: start at most one process per "
                    "GPU of a node (torchrun --nproc-per-node {}), or, to test several processes "
                    "on one GPU, {} (NCCL then treats each as a node and moves data over sockets, "
                    "NCCL_SOCKET_IFNAME=lo; slow, for tests only)",
                    who, env.localRank, visibleGpus, visibleGpus == 1 ? "" : "s",
                    std::max(visibleGpus, 1), fix);
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
