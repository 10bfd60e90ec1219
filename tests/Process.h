//===- Process.h - piperun in a real process a test signals and kills ----*- C++ -*-===//
//
// For the tests of long jobs (CheckpointTest.cpp, PreemptTest.cpp, GpuCheckpointTest.cpp): a
// command started in its own process with its output read as it comes (so that a test acts on
// a line, never after a delay), optionally under a file size limit (RLIMIT_FSIZE, SIGXFSZ at
// its default: piperun ignores it, so a write past it fails with EFBIG, as on a full disk); and a
// preemptible job's launcher, which kills the same command line at random instants and launches it
// again until it exits 0.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_PROCESS_H
#define PIPEC_TESTS_PROCESS_H

#include "tests/Command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <sys/resource.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace pipec::testing {

/// A command running in a process of its own (`sh -c "exec CMD"`, so that `pid` is the
/// command's), its standard output and error together on `fd`.
struct Child {
  pid_t pid = -1;
  int fd = -1;
  std::string out; // what it printed so far
};

/// Starts `cmd`; with `fileSizeLimit`, under that RLIMIT_FSIZE (SIGXFSZ at its default).
inline Child spawn(const std::string &cmd, rlim_t fileSizeLimit = RLIM_INFINITY) {
  int fds[2];
  Child c;
  if (::pipe(fds) != 0)
    return c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    if (fileSizeLimit != RLIM_INFINITY) {
      struct rlimit limit = {fileSizeLimit, fileSizeLimit};
      ::setrlimit(RLIMIT_FSIZE, &limit);
      // (SIGXFSZ left at its default, as a job under `ulimit -f` has it: the tools ignore it
      // themselves, so that a write past the limit is an error, not a kill.)
    }
    const std::string line = "exec " + cmd;
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char *>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  c.fd = fds[0];
  return c;
}

/// Reads `c`'s output until it holds `text` (true) or the process closes it (false).
inline bool readUntil(Child &c, const std::string &text) {
  char buf[4096];
  while (c.out.find(text) == std::string::npos) {
    ssize_t n = ::read(c.fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    c.out.append(buf, size_t(n));
  }
  return true;
}

/// Reads the rest of `c`'s output and waits for it; its wait status.
inline int finish(Child &c) {
  char buf[4096];
  for (ssize_t n; (n = ::read(c.fd, buf, sizeof buf)) != 0;)
    if (n > 0)
      c.out.append(buf, size_t(n));
    else if (errno != EINTR)
      break;
  ::close(c.fd);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return status;
}

/// Once `c`'s first step ended, sends it `signal` and waits for it to exit: its exit status in
/// `status` (a test failure where it printed no step or ended otherwise).
inline void signalAfterStepZero(Child &c, int signal, int &status) {
  ASSERT_TRUE(readUntil(c, "step 0 loss")) << c.out;
  ::kill(c.pid, signal);
  const int ended = finish(c);
  ASSERT_TRUE(WIFEXITED(ended)) << c.out;
  status = WEXITSTATUS(ended);
}

/// `pipec compile` of examples/tiny-gpt.json with `flags` into dir/plan.json (run from the
/// runfiles' root, as the tests are); the plan's path.
inline std::string compileTinyGpt(const std::string &dir, const std::string &flags) {
  std::string out = dir + "/plan.json";
  auto r = runCommand("tools/pipec compile --quiet --model examples/tiny-gpt.json " + flags +
                      " -o " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  return out;
}

/// The layer files of the checkpoint of step `step` in `dir` (name -> bytes): its weights and
/// AdamW moments.
inline std::map<std::string, std::string> checkpointLayerFiles(const std::string &dir, int step) {
  char name[32];
  std::snprintf(name, sizeof(name), "/step-%08d", step);
  std::map<std::string, std::string> m;
  for (auto &e : std::filesystem::directory_iterator(dir + name))
    if (e.path().filename().string().rfind("layer-", 0) == 0)
      m[e.path().filename().string()] = slurp(e.path().string());
  return m;
}

/// The milliseconds since `started` (at least 50): the span of a launcher's random kills, from
/// an uninterrupted run's time on this machine, however loaded.
inline int millisecondsSince(std::chrono::steady_clock::time_point started) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  started)
                .count();
  return int(std::max<int64_t>(50, ms));
}

/// A preemptible job's launcher: `cmd` (its output into `out`) launched, killed (SIGKILL) at a
/// random instant up to `spanMs` after its start, and launched again until it exits 0; every
/// eighth launch runs to its end (so that the job ends however the instants fall). The first
/// launch is killed by progress, not time: once it has printed its first or second step's loss
/// (the seed picks which), so that at least one launch is killed mid-job however the machine's
/// load changes between the uninterrupted run that measured `spanMs` and this one. Returns the
/// losses by step, each from the last launch that printed it (a step printed by two launches
/// must have the same loss), and counts the kills into `killed`.
inline std::map<int, std::string> relaunchUntilDone(const std::string &cmd, const std::string &out,
                                                    int spanMs, unsigned seed, int &killed) {
  std::mt19937 rng(seed);
  std::map<int, std::string> got;
  killed = 0;
  bool done = false;
  for (int launches = 0; !done && launches < 200; ++launches) {
    pid_t pid = ::fork();
    if (pid == 0) {
      const std::string line = "exec " + cmd + " >" + out + " 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char *>(nullptr));
      ::_exit(127);
    }
    const int delay = launches % 8 == 7 ? 1 << 30 : int(rng() % unsigned(spanMs));
    const size_t printedSteps = launches == 0 ? 1 + rng() % 2 : 0;
    int status = 0;
    for (int waited = 0; ::waitpid(pid, &status, WNOHANG) == 0; waited += 5) {
      // (A first launch that prints nothing is killed after ten spans, not waited for.)
      const bool due = launches == 0
                           ? stepLosses(slurp(out)).size() >= printedSteps || waited >= 10 * spanMs
                           : waited >= delay;
      if (due) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        ++killed;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const std::string printed = slurp(out);
    for (auto [step, loss] : stepLosses(printed)) {
      if (got.count(step)) { // a step run again (killed before its checkpoint): the same loss
        EXPECT_EQ(got[step], loss) << "step " << step << " again, launch " << launches;
      }
      got[step] = loss;
    }
    done = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (WIFEXITED(status) && !done) {
      ADD_FAILURE() << "launch " << launches << " exited " << WEXITSTATUS(status) << ":\n"
                    << printed;
      break;
    }
  }
  EXPECT_TRUE(done) << "the job did not finish in 200 launches";
  return got;
}

} // namespace pipec::testing

#endif // PIPEC_TESTS_PROCESS_H
