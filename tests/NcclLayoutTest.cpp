//===- NcclLayoutTest.cpp - The nccl mode's launch variables and communicators -===//
//
// Runs everywhere (no CUDA needed): what runtime/cuda/NcclLayout.h decides before any NCCL call
// — the launcher's variables checked against the plan, RANK to (pp, dp, tp) in the plan's
// tp-dp-pp order, and the communicators every process creates, which must be the same kinds in
// the same order on every process and group exactly the ranks the interpreter's all-reduces and
// sends name.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "ir/support/Error.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Interpreter.h"
#include "runtime/Reference.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cuda/NcclLayout.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

namespace pipec::test {
namespace {

using Env = std::map<std::string, std::string>;

llvm::Expected<LaunchEnv> launch(const Plan &plan, const Env &env) {
  return launchEnvOf(plan, [&env](const char *name) -> const char * {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string errorOf(llvm::Expected<LaunchEnv> e) {
  if (e)
    return "";
  EXPECT_TRUE(e.errorIsA<InputError>());
  return takeMessage(e.takeError());
}

Plan pp2tp2dp2(bool tied = false) {
  return compileOrFail(tinyGpt(tied, /*layers=*/6),
                       options("1f1b", /*pp=*/2, /*microbatches=*/4, 1, 1, /*tp=*/2, /*dp=*/2));
}

TEST(NcclLaunchEnvTest, AMissingRankIsAnErrorNamingTheVariable) {
  Plan plan = pp2tp2dp2();
  std::string e = errorOf(launch(plan, {{"WORLD_SIZE", "8"}, {"LOCAL_RANK", "0"}}));
  EXPECT_NE(e.find("RANK is not set"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(NcclLaunchEnvTest, AMissingWorldSizeSaysHowManyProcessesThePlanNeeds) {
  std::string e = errorOf(launch(pp2tp2dp2(), {{"RANK", "0"}, {"LOCAL_RANK", "0"}}));
  EXPECT_NE(e.find("WORLD_SIZE is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("WORLD_SIZE=8"), std::string::npos) << e;
}

TEST(NcclLaunchEnvTest, AWorldSizeOtherThanPpTimesDpTimesTpNamesBoth) {
  std::string e = errorOf(
      launch(pp2tp2dp2(),
             {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"NCCL_COMM_ID", "h:1"}}));
  EXPECT_NE(e.find("WORLD_SIZE=4 but the plan needs pp 2 x dp 2 x tp 2 = 8"), std::string::npos)
      << e;
}

TEST(NcclLaunchEnvTest, ARankOutsideTheWorldOrANonNumberIsAnError) {
  Plan plan = pp2tp2dp2();
  EXPECT_NE(errorOf(launch(plan, {{"RANK", "8"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "0"}}))
                .find("RANK=8 is not an integer in [0, 7]"),
            std::string::npos);
  EXPECT_NE(errorOf(launch(plan, {{"RANK", "x"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "0"}}))
                .find("RANK=x"),
            std::string::npos);
  EXPECT_NE(errorOf(launch(plan, {{"RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}}))
                .find("LOCAL_RANK=2"),
            std::string::npos);
}

TEST(NcclLaunchEnvTest, SeveralProcessesNeedNcclCommIdAsHostAndPort) {
  Plan plan = pp2tp2dp2();
  Env env{{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}};
  EXPECT_NE(errorOf(launch(plan, env)).find("NCCL_COMM_ID is not set"), std::string::npos);
  env["NCCL_COMM_ID"] = "node0";
  EXPECT_NE(errorOf(launch(plan, env)).find("NCCL_COMM_ID=node0 is not host:port"),
            std::string::npos);
  env["NCCL_COMM_ID"] = "node0:29600";
  auto ok = launch(plan, env);
  ASSERT_TRUE(bool(ok)) << takeMessage(ok.takeError());
  EXPECT_EQ(*ok->commId, "node0:29600");
}

TEST(NcclLaunchEnvTest, OneProcessNeedsNoNcclCommId) {
  Plan plan =
      compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/1, /*microbatches=*/2));
  auto ok = launch(plan, {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  ASSERT_TRUE(bool(ok)) << takeMessage(ok.takeError());
  EXPECT_FALSE(ok->commId.has_value());
}

TEST(NcclLaunchEnvTest, RankMapsToCoordinatesInTheInterpretersTpDpPpOrder) {
  Plan plan = pp2tp2dp2();
  RunShared shared(plan, Faults{});
  for (int r = 0; r < 8; ++r) {
    auto env = launch(plan, {{"RANK", std::to_string(r)},
                             {"WORLD_SIZE", "8"},
                             {"LOCAL_RANK", "0"},
                             {"NCCL_COMM_ID", "h:1"}});
    ASSERT_TRUE(bool(env)) << takeMessage(env.takeError());
    Coord c = shared.coordOf(r);
    EXPECT_EQ(env->coord.pp, c.pp) << r;
    EXPECT_EQ(env->coord.dp, c.dp) << r;
    EXPECT_EQ(env->coord.tp, c.tp) << r;
    EXPECT_EQ(shared.threadOf(env->coord), r);
  }
}

// The launchers' own variables, as their documentation names them: srun's output environment
// (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and SLURM_STEP_ID, set in a job step's
// tasks), Open MPI's OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK, MVAPICH2's MV2_COMM_WORLD_*,
// and MPICH's and Intel MPI's Hydra PMI_RANK, PMI_SIZE and MPI_LOCALRANKID. No wrapper script
// maps them to RANK, WORLD_SIZE and LOCAL_RANK.
struct LauncherCase {
  const char *name;
  Env vars; // rank 5 of 8, the second process of its node
};

const std::vector<LauncherCase> &launcherCases() {
  static const std::vector<LauncherCase> cases = {
      {"torchrun", {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}}},
      {"srun",
       {{"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "5"},
        {"SLURM_STEP_NUM_TASKS", "8"},
        {"SLURM_NTASKS", "16"}, // the job's, as srun --preserve-env leaves it
        {"SLURM_LOCALID", "1"}}},
      {"Open MPI's mpirun",
       {{"OMPI_COMM_WORLD_RANK", "5"},
        {"OMPI_COMM_WORLD_SIZE", "8"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}},
      {"MVAPICH2's mpirun_rsh",
       {{"MV2_COMM_WORLD_RANK", "5"},
        {"MV2_COMM_WORLD_SIZE", "8"},
        {"MV2_COMM_WORLD_LOCAL_RANK", "1"}}},
      {"MPICH's or Intel MPI's mpiexec",
       {{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}, {"MPI_LOCALRANKID", "1"}}}};
  return cases;
}

TEST(NcclLaunchEnvTest, EachLaunchersOwnVariablesPlaceTheProcessWithoutAWrapper) {
  Plan plan = pp2tp2dp2();
  RunShared shared(plan, Faults{});
  for (const LauncherCase &c : launcherCases()) {
    Env env = c.vars;
    env["NCCL_COMM_ID"] = "node0:29600";
    auto e = launch(plan, env);
    ASSERT_TRUE(bool(e)) << c.name << ": " << takeMessage(e.takeError());
    EXPECT_STREQ(e->launcher->name, c.name);
    EXPECT_EQ(e->rank, 5) << c.name;
    EXPECT_EQ(e->worldSize, 8) << c.name;
    EXPECT_EQ(e->localRank, 1) << c.name;
    EXPECT_EQ(shared.threadOf(e->coord), 5) << c.name;
    // The description names the variables this launcher set, with their values.
    for (const auto &[name, value] : c.vars) {
      if (name != "SLURM_STEP_ID" && name != "SLURM_NTASKS") {
        EXPECT_NE(e->describe().find(name + "=" + value), std::string::npos)
            << c.name << ": " << e->describe();
      }
    }
  }
}

TEST(NcclLaunchEnvTest, ALauncherStartedByAnotherWinsOverTheVariablesItInherits) {
  Plan plan = pp2tp2dp2();
  // What srun set for the one task per node that runs torchrun's agent, mpirun's daemon or
  // Hydra's proxy: every process those start inherits it (and torchrun's below Open MPI's,
  // for mpirun --npernode 1 torchrun ...).
  const Env srunStep{{"SLURM_STEP_ID", "3"},
                     {"SLURM_PROCID", "0"},
                     {"SLURM_STEP_NUM_TASKS", "2"},
                     {"SLURM_LOCALID", "0"},
                     {"NCCL_COMM_ID", "node0:29600"}};
  for (const LauncherCase &c : launcherCases()) {
    if (std::string(c.name) == "srun")
      continue;
    Env env = srunStep;
    if (std::string(c.name) == "torchrun")
      env.insert({{"OMPI_COMM_WORLD_RANK", "1"},
                  {"OMPI_COMM_WORLD_SIZE", "2"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
    env.insert(c.vars.begin(), c.vars.end());
    auto e = launch(plan, env);
    ASSERT_TRUE(bool(e)) << c.name << ": " << takeMessage(e.takeError());
    EXPECT_STREQ(e->launcher->name, c.name);
    EXPECT_EQ(e->rank, 5) << c.name;
    EXPECT_EQ(e->worldSize, 8) << c.name;
  }
  // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE too, but not Hydra's MPI_LOCALRANKID: srun's
  // variables place it.
  Env pmi2{{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "6"}, {"SLURM_STEP_NUM_TASKS", "8"},
           {"SLURM_LOCALID", "2"}, {"PMI_RANK", "6"},     {"PMI_SIZE", "8"},
           {"NCCL_COMM_ID", "h:1"}};
  auto e = launch(plan, pmi2);
  ASSERT_TRUE(bool(e)) << takeMessage(e.takeError());
  EXPECT_STREQ(e->launcher->name, "srun");
  EXPECT_EQ(e->localRank, 2);
}

TEST(NcclLaunchEnvTest, AnInteractiveSrunStepIsOneTaskAndTheErrorSaysHowManyToLaunch) {
  // srun --pty bash (or salloc's interactive step) is a step of one task, with srun's step id
  // for it: piperun run from its shell is that one task, and the plan needs 8.
  std::string e = errorOf(launch(pp2tp2dp2(), {{"SLURM_STEP_ID", "4294967290"},
                                               {"SLURM_PROCID", "0"},
                                               {"SLURM_STEP_NUM_TASKS", "1"},
                                               {"SLURM_NTASKS", "1"},
                                               {"SLURM_LOCALID", "0"}}));
  EXPECT_NE(e.find("--backend nccl: SLURM_STEP_NUM_TASKS=1 but the plan needs pp 2 x dp 2 x tp 2 "
                   "= 8 processes; launch 8 (e.g. srun --ntasks 8)"),
            std::string::npos)
      << e;
}

TEST(NcclLaunchEnvTest, ASlurmBatchScriptIsNotALaunchAndTheErrorSaysToUseSrun) {
  // An sbatch script's shell has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step id: it
  // is one process, and taking it for rank 0 of 8 would wait for 7 that never start.
  std::string e = errorOf(launch(pp2tp2dp2(), {{"SLURM_PROCID", "0"},
                                               {"SLURM_NTASKS", "8"},
                                               {"SLURM_LOCALID", "0"},
                                               {"SLURM_JOB_ID", "42"}}));
  EXPECT_NE(e.find("RANK is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("SLURM_PROCID is set but SLURM_STEP_ID is not"), std::string::npos) << e;
  EXPECT_NE(e.find("srun --ntasks 8"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(NcclLaunchEnvTest, APmiRankWithoutHydrasLocalRankSaysWhatIsMissing) {
  // Another launcher's PMI (not Hydra's, not inside an srun step) gives no GPU on the node.
  std::string e = errorOf(launch(pp2tp2dp2(), {{"PMI_RANK", "3"}, {"PMI_SIZE", "8"}}));
  EXPECT_NE(e.find("PMI_RANK is set but MPI_LOCALRANKID is not: this process was not started by "
                   "MPICH's or Intel MPI's mpiexec"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("SLURM_PROCID is set"), std::string::npos) << e;
}

TEST(NcclLaunchEnvTest, NothingSetListsEveryLaunchersVariables) {
  std::string e = errorOf(launch(pp2tp2dp2(), {}));
  EXPECT_EQ(e.rfind("--backend nccl: RANK is not set; ", 0), 0u) << e;
  for (const Launcher &l : launchers())
    for (const char *v : {l.rankVar, l.sizeVar, l.localRankVar})
      EXPECT_NE(e.find(v), std::string::npos) << v << " missing from: " << e;
  EXPECT_NE(e.find("WORLD_SIZE=8"), std::string::npos) << e;
  EXPECT_EQ(e.find("SLURM_STEP_ID is not"), std::string::npos) << e; // no Slurm here
}

TEST(NcclLaunchEnvTest, ErrorsUnderALauncherNameItsVariablesAndItsCommandLine) {
  Plan plan = pp2tp2dp2();
  std::string e = errorOf(launch(plan, {{"SLURM_STEP_ID", "0"},
                                        {"SLURM_PROCID", "0"},
                                        {"SLURM_STEP_NUM_TASKS", "4"},
                                        {"SLURM_LOCALID", "0"},
                                        {"NCCL_COMM_ID", "h:1"}}));
  EXPECT_NE(e.find("--backend nccl: SLURM_STEP_NUM_TASKS=4 but the plan needs pp 2 x dp 2 x tp 2 "
                   "= 8 processes; launch 8 (e.g. srun --ntasks 8)"),
            std::string::npos)
      << e;
  e = errorOf(launch(plan, {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "8"}}));
  EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK is not set; Open MPI's mpirun sets "
                   "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("mpirun -np 8"), std::string::npos) << e;
  e = errorOf(launch(plan, {{"PMI_RANK", "9"}, {"PMI_SIZE", "8"}, {"MPI_LOCALRANKID", "0"}}));
  EXPECT_NE(e.find("PMI_RANK=9 is not an integer in [0, 7]"), std::string::npos) << e;
  // Open MPI passes a variable to other nodes only with -x: the fix says so.
  e = errorOf(launch(plan, {{"OMPI_COMM_WORLD_RANK", "1"},
                            {"OMPI_COMM_WORLD_SIZE", "8"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  EXPECT_NE(e.find("NCCL_COMM_ID is not set; with OMPI_COMM_WORLD_SIZE=8 > 1"), std::string::npos)
      << e;
  EXPECT_NE(e.find("mpirun -x NCCL_COMM_ID="), std::string::npos) << e;
  e = errorOf(launch(plan, {{"SLURM_STEP_ID", "0"},
                            {"SLURM_PROCID", "1"},
                            {"SLURM_STEP_NUM_TASKS", "8"},
                            {"SLURM_LOCALID", "1"}}));
  EXPECT_NE(e.find("scontrol show hostnames"), std::string::npos) << e;
}

// NCCL's own words for two ranks on one GPU (libnccl.so.2's format string "Duplicate GPU
// detected : rank %d and rank %d both on CUDA device %lx", as ncclGetLastError returns it).
TEST(NcclSharedGpuTest, NcclsDuplicateGpuErrorBecomesOneLineNamingBothRanksAndNcclHostId) {
  LaunchEnv env;
  env.rank = 1;
  env.worldSize = 2;
  env.localRank = 1;
  llvm::Error err = sharedGpuError(
      "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000", env, 1, nullptr);
  ASSERT_TRUE(bool(err));
  EXPECT_TRUE(err.isA<InputError>());
  std::string m = takeMessage(std::move(err));
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(m.rfind("--backend nccl: RANK 1 and RANK 0 share one GPU (this process, LOCAL_RANK=1, "
                    "sees 1 GPU)",
                    0),
            0u)
      << m;
  EXPECT_NE(m.find("torchrun --nproc-per-node 1"), std::string::npos) << m;
  EXPECT_NE(m.find("give each its own NCCL_HOSTID"), std::string::npos) << m;
  EXPECT_NE(m.find("NCCL_SOCKET_IFNAME=lo"), std::string::npos) << m;
}

TEST(NcclSharedGpuTest, ASharedNcclHostIdIsNamedWithItsValue) {
  LaunchEnv env;
  env.rank = 3;
  env.worldSize = 4;
  env.localRank = 3;
  std::string m = takeMessage(sharedGpuError(
      "Duplicate GPU detected : rank 3 and rank 2 both on CUDA device 4000", env, 2, "box"));
  EXPECT_NE(m.find("RANK 3 and RANK 2 share one GPU (this process, LOCAL_RANK=3, sees 2 GPUs)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("torchrun --nproc-per-node 2"), std::string::npos) << m;
  EXPECT_NE(m.find("give each a different NCCL_HOSTID (this one's, box, is another's too)"),
            std::string::npos)
      << m;
}

TEST(NcclSharedGpuTest, UnderSrunItNamesSrunsVariableAndOption) {
  auto env = launch(pp2tp2dp2(), {{"SLURM_STEP_ID", "0"},
                                  {"SLURM_PROCID", "3"},
                                  {"SLURM_STEP_NUM_TASKS", "8"},
                                  {"SLURM_LOCALID", "3"},
                                  {"NCCL_COMM_ID", "h:1"}});
  ASSERT_TRUE(bool(env)) << takeMessage(env.takeError());
  std::string m = takeMessage(sharedGpuError(
      "Duplicate GPU detected : rank 3 and rank 2 both on CUDA device 4000", *env, 2, nullptr));
  EXPECT_NE(m.find("(this process, SLURM_LOCALID=3, sees 2 GPUs)"), std::string::npos) << m;
  EXPECT_NE(m.find("srun --ntasks-per-node 2"), std::string::npos) << m;
}

TEST(NcclSharedGpuTest, OtherNcclErrorsAreLeftToNcclsOwnMessage) {
  LaunchEnv env;
  EXPECT_FALSE(bool(sharedGpuError("", env, 1, nullptr)));
  EXPECT_FALSE(bool(sharedGpuError("Invalid config blocking attribute value -1", env, 1, nullptr)));
  // Words NCCL may change around the ranks still give the hint, without the ranks.
  std::string m = takeMessage(
      sharedGpuError("init.cc:500 Duplicate GPU detected on device 0", env, 1, nullptr));
  EXPECT_EQ(m.rfind("--backend nccl: two processes share one GPU", 0), 0u) << m;
}

/// The groups a communicator kind forms over all processes: color -> (key -> rank).
std::map<int, std::map<int, int>> groupsOf(const Plan &plan, CommKind kind) {
  std::map<int, std::map<int, int>> groups;
  int world = plan.parallel.pp * plan.parallel.dp * plan.parallel.tp;
  for (int r = 0; r < world; ++r)
    for (const CommSpec &s : commLayout(plan, r))
      if (s.kind == kind && s.color >= 0) {
        EXPECT_FALSE(groups[s.color].count(s.key)) << "two ranks with one key";
        groups[s.color][s.key] = r;
      }
  return groups;
}

TEST(NcclCommLayoutTest, EveryProcessCreatesTheSameCommunicatorsInTheSameOrder) {
  Plan plan = pp2tp2dp2(/*tied=*/true);
  std::vector<CommKind> first;
  for (const CommSpec &s : commLayout(plan, 0))
    first.push_back(s.kind);
  EXPECT_EQ(first, (std::vector<CommKind>{CommKind::World, CommKind::Pipeline, CommKind::Tp,
                                          CommKind::Dp, CommKind::Embedding}));
  for (int r = 1; r < 8; ++r) {
    std::vector<CommKind> kinds;
    for (const CommSpec &s : commLayout(plan, r))
      kinds.push_back(s.kind);
    EXPECT_EQ(kinds, first) << "rank " << r;
  }
}

TEST(NcclCommLayoutTest, GroupsHoldTheRanksTheInterpreterNamesInItsMemberOrder) {
  Plan plan = pp2tp2dp2(/*tied=*/true);
  RunShared shared(plan, Faults{});
  const ParallelConfig &pc = plan.parallel;
  // pipeline: key = pipeline rank, so a plan's `peer` is the NCCL peer.
  auto pipes = groupsOf(plan, CommKind::Pipeline);
  EXPECT_EQ(pipes.size(), size_t(pc.dp * pc.tp));
  for (auto &[color, members] : pipes)
    for (auto [key, rank] : members) {
      EXPECT_EQ(shared.coordOf(rank).pp, key);
      EXPECT_EQ(shared.coordOf(rank).dp * pc.tp + shared.coordOf(rank).tp, color);
    }
  // tp: members of (pp, dp) in tp order; dp: members of (pp, tp) in dp order.
  for (auto &[color, members] : groupsOf(plan, CommKind::Tp))
    for (auto [key, rank] : members)
      EXPECT_EQ(rank, shared.threadOf(Coord{color / pc.dp, color % pc.dp, key}));
  for (auto &[color, members] : groupsOf(plan, CommKind::Dp))
    for (auto [key, rank] : members)
      EXPECT_EQ(rank, shared.threadOf(Coord{color / pc.tp, key, color % pc.tp}));
  // embedding: the first and the last stage's rank of each (dp, tp), first stage's as key 0.
  auto emb = groupsOf(plan, CommKind::Embedding);
  EXPECT_EQ(emb.size(), size_t(pc.dp * pc.tp));
  for (auto &[color, members] : emb) {
    ASSERT_EQ(members.size(), 2u);
    EXPECT_EQ(shared.coordOf(members.at(0)).pp, plan.rankOf(0));
    EXPECT_EQ(shared.coordOf(members.at(1)).pp, plan.rankOf(plan.numStages() - 1));
  }
}

TEST(NcclCommLayoutTest, PipelineOfTwoIsOneCommunicatorWhosePeersAreBothDirections) {
  // pp = 2: prev and next are the same process; one pipeline communicator of two ranks carries
  // both directions, matched FIFO in the verified plan order.
  Plan plan =
      compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/2, /*microbatches=*/4));
  auto pipes = groupsOf(plan, CommKind::Pipeline);
  ASSERT_EQ(pipes.size(), 1u);
  EXPECT_EQ(pipes.begin()->second.size(), 2u);
  std::set<int> peers0, peers1;
  for (const Instruction &i : plan.ranks[0])
    if (i.isP2P())
      peers0.insert(i.peer);
  for (const Instruction &i : plan.ranks[1])
    if (i.isP2P())
      peers1.insert(i.peer);
  EXPECT_EQ(peers0, std::set<int>{1});
  EXPECT_EQ(peers1, std::set<int>{0});
}

TEST(NcclCommLayoutTest, OnlyTheCommunicatorsThePlanUsesAreCreated) {
  Plan plan =
      compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/1, /*microbatches=*/2));
  auto layout = commLayout(plan, 0);
  ASSERT_EQ(layout.size(), 1u);
  EXPECT_EQ(layout[0].kind, CommKind::World);
  // Tied embeddings whose copies share a rank (V-shape) need no embedding communicator.
  Plan v = compileOrFail(tinyGpt(true), options("zb-v", /*pp=*/2, /*microbatches=*/4, /*vpp=*/2));
  for (const CommSpec &s : commLayout(v, 0))
    EXPECT_NE(s.kind, CommKind::Embedding);
}

TEST(NcclCommLayoutTest, NonMembersOfTheEmbeddingGroupStillJoinItsSplit) {
  // pp = 3: rank 1 holds neither the first nor the last stage, but ncclCommSplit is
  // collective over `world`, so they take part with no color.
  Plan plan = compileOrFail(tinyGpt(true), options("1f1b", /*pp=*/3, /*microbatches=*/4));
  for (int r = 0; r < 3; ++r) {
    auto layout = commLayout(plan, r);
    ASSERT_EQ(layout.back().kind, CommKind::Embedding) << r;
    EXPECT_EQ(layout.back().color < 0, r == 1) << r;
  }
}

TEST(NcclGradientGatherTest, EveryBlockOfReplicaZeroOutsideRankZeroIsGatheredOnceAtItsSize) {
  // What --check-reference with several processes sends to RANK 0: each (stage, tp rank) of dp
  // replica 0 held by another process, once, sized as the CPU stage that holds those layers.
  for (bool interleaved : {false, true}) {
    Plan plan = interleaved
                    ? compileOrFail(tinyGpt(false, /*layers=*/6),
                                    options("interleaved-1f1b", /*pp=*/2, /*microbatches=*/4,
                                            /*vpp=*/2, 1, /*tp=*/2, /*dp=*/2))
                    : pp2tp2dp2();
    auto cfg = gptConfigOf(plan);
    ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
    auto shards = gradientShards(
        plan, [&](int l) { return kernels::layerParamCount(*cfg, l, plan.parallel.tp); });
    RunShared shared(plan, Faults{});
    std::set<std::pair<int, int>> seen;
    int lastRank = 0;
    for (const GradientShard &g : shards) {
      EXPECT_GE(g.rank, lastRank) << "shards are ordered by rank";
      lastRank = g.rank;
      Coord c = shared.coordOf(g.rank);
      EXPECT_NE(g.rank, 0);
      EXPECT_EQ(c.dp, 0) << "rank " << g.rank << " is not in replica 0";
      EXPECT_EQ(c.tp, g.tp);
      const StageInfo &st = plan.stages[size_t(g.stage)];
      EXPECT_EQ(st.rank, c.pp) << "stage " << g.stage << " is not on rank " << g.rank;
      EXPECT_TRUE(seen.insert({g.stage, g.tp}).second) << "stage " << g.stage << " tp " << g.tp;
      kernels::StageCompute holder(*cfg, st.layerBegin, st.layerEnd, g.tp, plan.parallel.tp,
                                   /*seed=*/1, slicesOf(plan), 1.0f);
      EXPECT_EQ(g.floats, holder.grads().size()) << "stage " << g.stage << " tp " << g.tp;
    }
    // With RANK 0's own blocks, every (stage, tp) of replica 0.
    for (const StageInfo &st : plan.stages)
      for (int t = 0; t < plan.parallel.tp; ++t)
        if (st.rank == 0 && t == 0) {
          EXPECT_FALSE(seen.count({st.stage, t}));
        } else {
          EXPECT_TRUE(seen.count({st.stage, t})) << "stage " << st.stage << " tp " << t;
        }
  }
}

TEST(NcclGradientGatherTest, RankZerosRecvsMirrorEverySendersSendsInOrderAndSize) {
  Plan plan = pp2tp2dp2();
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
  auto shards = gradientShards(
      plan, [&](int l) { return kernels::layerParamCount(*cfg, l, plan.parallel.tp); });
  const int world = plan.parallel.pp * plan.parallel.dp * plan.parallel.tp;
  auto root = gatherGroups(shards, 0);
  size_t next = 0; // RANK 0's groups are taken in order, one per sender
  for (int q = 1; q < world; ++q) {
    auto mine = gatherGroups(shards, q);
    if (mine.empty())
      continue; // not in replica 0: posts nothing, and RANK 0 expects nothing from it
    ASSERT_EQ(mine.size(), 1u) << "rank " << q;
    ASSERT_LT(next, root.size()) << "RANK 0 has no group for rank " << q;
    const auto &sends = mine[0], &recvs = root[next++];
    ASSERT_EQ(sends.size(), recvs.size()) << "rank " << q;
    for (size_t k = 0; k < sends.size(); ++k) {
      EXPECT_TRUE(sends[k].send);
      EXPECT_EQ(sends[k].peer, 0);
      EXPECT_FALSE(recvs[k].send);
      EXPECT_EQ(recvs[k].peer, q);
      EXPECT_EQ(sends[k].shard.floats, recvs[k].shard.floats);
      EXPECT_EQ(sends[k].shard.stage, recvs[k].shard.stage);
      EXPECT_EQ(sends[k].shard.tp, recvs[k].shard.tp);
    }
  }
  EXPECT_EQ(next, root.size()) << "RANK 0 waits for a sender that sends nothing";
}

} // namespace
} // namespace pipec::test
