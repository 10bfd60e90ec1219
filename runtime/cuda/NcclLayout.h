//===- NcclLayout.h - Who this process is and which communicators it makes -*- C++ -*-===//
//
// The CUDA-free half of the `nccl` mode (one process per GPU, docs/runtime.md), so that CI tests
// it:
//   - launchEnvOf reads what the launcher set, in its own variables (torchrun's RANK,
//     WORLD_SIZE and LOCAL_RANK; srun's SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID;
//     Open MPI's mpirun's, MVAPICH2's mpirun_rsh's, MPICH's or Intel MPI's mpiexec's;
//     `launchers()`), and NCCL_COMM_ID
//     (host:port of RANK 0, NCCL's own bootstrap), and checks them against the plan's
//     pp x dp x tp; every mistake is an InputError naming the variable and a valid value;
//   - commLayout lists the communicators a process creates, eagerly and in the same order on
//     every process (USER-ASKS "what a new system must do" 2): `world` by ncclCommInitRank, then
//     ncclCommSplit children of it: `pipeline` (the pp ranks of one (dp, tp) replica; the plan's
//     sends and recvs, peer = pipeline rank), `tp`, `dp` and `embedding` (the first and last
//     stage's ranks of one (dp, tp), when tied embeddings live on two ranks). A split is
//     collective over its parent, so every process calls every split of the list; a process
//     outside a group passes color -1 (NCCL_SPLIT_NOCOLOR). The list depends on the plan only,
//     never on the rank, except for colors and keys.
// Global rank of (pp, dp, tp) is the plan's tp-dp-pp order, RunShared::threadOf.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_NCCLLAYOUT_H
#define PIPEC_RUNTIME_CUDA_NCCLLAYOUT_H

#include "ir/Plan.h"
#include "runtime/Interpreter.h"

#include "llvm/Support/Error.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// A launcher's variables for a process's global rank, the number of processes and the
/// process's rank on its node (its GPU), and how to ask it for a number of processes.
struct Launcher {
  const char *name;
  const char *rankVar, *sizeVar, *localRankVar;
  /// Set in the processes this launcher starts and in no others (the rank variable, or for
  /// srun SLURM_STEP_ID: an sbatch script's shell has SLURM_PROCID=0 too, but no step id).
  const char *marker;
  /// When the rank variable is set but not the marker: what that process is, and what to do
  /// ("{}" is the number of processes the plan needs); nullptr when the two are one variable.
  const char *withoutMarker;
  /// The command line, with the count in it, for `n` processes in all, and for at most `n` on
  /// each node.
  std::string (*total)(int n);
  std::string (*perNode)(int n);
  /// How to give every process the same NCCL_COMM_ID under this launcher.
  const char *commIdHint;
};

/// Every launcher launchEnvOf knows, in the order it looks for them: the first whose marker is
/// set wins (a launcher started by another, such as torchrun or mpirun inside an srun step,
/// comes first, so that its own variables win over those it inherits); torchrun's variables,
/// the first entry, are also the ones asked for when no marker is set.
const std::vector<Launcher> &launchers();

struct LaunchEnv {
  int rank = 0, worldSize = 1, localRank = 0;
  Coord coord;                       // of `rank`
  std::optional<std::string> commId; // NCCL_COMM_ID, required when worldSize > 1
  // NCCL's own settings (NCCL reads them itself), for the errors that explain its failures:
  std::optional<std::string> hostId; // NCCL_HOSTID
  /// How long a rank other than 0 retries connecting to RANK 0's bootstrap root: the k-th of
  /// NCCL_SOCKET_RETRY_CNT (34) retries after k times NCCL_SOCKET_RETRY_SLEEP_MSEC (100 ms).
  double rootRetrySeconds = 59.5;
  const Launcher *launcher = &launchers().front(); // whose variables rank, worldSize came from
  /// For messages, in the launcher's variables: "RANK=3 WORLD_SIZE=4 LOCAL_RANK=3".
  std::string describe() const;
};

/// Reads the launcher's variables through `getenv` (the binary passes ::getenv) and checks
/// them against `plan`: the variables of the first of `launchers()` whose marker is set, else
/// torchrun's.
llvm::Expected<LaunchEnv> launchEnvOf(const Plan &plan,
                                      const std::function<const char *(const char *)> &getenv);

enum class CommKind { World, Pipeline, Tp, Dp, Embedding };
const char *toString(CommKind k);

/// One communicator of the list: ncclCommSplit(world, color, key) (world: ncclCommInitRank,
/// color 0, key = rank). color -1: this process is not a member (its split returns no comm).
struct CommSpec {
  CommKind kind = CommKind::World;
  int color = 0, key = 0;
  int size = 0; // members of this process's group (0 when not a member)
};

/// The communicators of process `rank`, in creation order (the same kinds on every process).
std::vector<CommSpec> commLayout(const Plan &plan, int rank);

/// The process (RANK) of pipeline rank `c.pp`, dp replica `c.dp`, tp rank `c.tp`.
int worldRankOf(const Plan &plan, const Coord &c);

/// NCCL (2.5 and later) refuses two ranks of one communicator on the same GPU of the same host:
/// ncclCommInitRank fails with ncclInvalidUsage, its last error reading "Duplicate GPU detected :
/// rank A and rank B both on CUDA device X". For that last error, the InputError piperun prints
/// instead (one line: both ranks, how many GPUs this process sees, and the two ways out: one
/// process per GPU, or a NCCL_HOSTID of its own for each process to test on one GPU); for any
/// other, success (the caller keeps NCCL's own error). `hostId`: this process's NCCL_HOSTID
/// (nullptr when unset; when set, another process on this GPU has the same).
llvm::Error sharedGpuError(const std::string &ncclLastError, const LaunchEnv &env, int visibleGpus,
                           const char *hostId);

/// One (stage, tp rank) block of dp replica 0's gradients, held by process `rank`.
struct GradientShard {
  int rank = 0, stage = 0, tp = 0;
  size_t floats = 0;
};

/// What --check-reference with several processes gathers on RANK 0 after each step: every
/// block of replica 0's gradients held by another process, by rank, then stage (the order in
/// which both ends post their NCCL sends and recvs). `layerFloats(layer)` is a layer's
/// parameter count on one tp rank (kernels::layerParamCount).
std::vector<GradientShard> gradientShards(const Plan &plan,
                                          const std::function<size_t(int)> &layerFloats);

/// One NCCL send or recv of the gather, as process `rank` posts it.
struct GatherOp {
  bool send = false;
  int peer = 0; // a world rank
  GradientShard shard;
};

/// Process `rank`'s part of the gather, one NCCL group per inner list, in posting order: a
/// sender's single group of sends to RANK 0, or RANK 0's group of recvs per sender (by rank).
std::vector<std::vector<GatherOp>> gatherGroups(const std::vector<GradientShard> &shards, int rank);

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_NCCLLAYOUT_H
