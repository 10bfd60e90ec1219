#include "runtime/Runner.h"

#include "ir/PlanText.h"
#include "ir/support/Error.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

namespace pipec {

Runner::Runner(const Plan &plan, Faults faults, double timeoutSeconds,
               std::vector<std::unique_ptr<Backend>> backends, Clock &clock)
    : shared(plan, std::move(faults)), timeout(timeoutSeconds), clock(clock),
      backends(std::move(backends)) {
  assert(int(this->backends.size()) == shared.numThreads() && "one backend per thread");
}

Runner::Runner(const Plan &plan, Faults faults, double timeoutSeconds,
               std::vector<std::unique_ptr<Backend>> backends, Transport &transport, Clock &clock)
    : shared(plan, std::move(faults), transport), timeout(timeoutSeconds), clock(clock),
      backends(std::move(backends)) {
  assert(int(this->backends.size()) == shared.numThreads() && "one backend per thread");
}

std::string Runner::stallReport(double seconds, int step) const {
  const Plan &plan = shared.plan;
  std::string lines;
  std::vector<GridMark> marks;
  for (int r = 0; r < plan.numRanks(); ++r) {
    // The replica furthest behind speaks for its pipeline rank.
    size_t pos = SIZE_MAX;
    for (int t = 0; t < shared.numThreads(); ++t)
      if (shared.coordOf(t).pp == r)
        pos = std::min(pos, shared.position[size_t(t)].load());
    const auto &stream = plan.ranks[size_t(r)];
    std::string last =
        pos == 0 ? std::string("none")
                 : fmt::format("step {} ({})", pos - 1, formatToken(plan, stream[pos - 1]));
    std::string pending = pos >= stream.size()
                              ? std::string("none (finished)")
                              : fmt::format("step {} ({})", pos, formatToken(plan, stream[pos]));
    // A group is posted (and waits) as a whole: name every op in it.
    if (pos < stream.size() && stream[pos].isP2P() && stream[pos].group != kNoGroup) {
      size_t end = pos + 1;
      while (end < stream.size() && stream[end].isP2P() && stream[end].group == stream[pos].group)
        ++end;
      if (end - pos > 1) {
        std::string toks;
        for (size_t k = pos; k < end; ++k)
          toks += (toks.empty() ? "" : " ") + formatToken(plan, stream[k]);
        pending = fmt::format("group of steps {}-{} ({})", pos, end - 1, toks);
      }
    }
    lines += fmt::format("\n  rank {}: last completed {}, pending {}", r, last, pending);
    if (pos < stream.size())
      marks.push_back(GridMark{r, pos});
  }
  return fmt::format("watchdog: no rank made progress for {:.1f} s in step {}{}\n{}", seconds, step,
                     lines, formatGrid(plan, marks));
}

llvm::Error Runner::step(int index) {
  int n = shared.numThreads();
  for (auto &p : shared.position)
    p.store(0);
  std::mutex mu;
  std::string firstError;
  bool firstIsInput = false;
  std::atomic<int> finished{0};
  // The last thread to finish wakes the watchdog, so a step ends when its threads do, not at
  // the watchdog's next 5 ms tick.
  std::mutex finishedMu;
  std::condition_variable allFinished;
  std::vector<std::thread> threads;
  threads.reserve(size_t(n));
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      Coord c = shared.coordOf(t);
      llvm::Error err = backends[size_t(t)]->beginStep(index);
      if (!err)
        err = interpretStep(shared, c, *backends[size_t(t)]);
      if (err) {
        bool input = err.isA<InputError>();
        std::string msg = takeMessage(std::move(err));
        {
          std::lock_guard<std::mutex> lock(mu);
          if (firstError.empty()) {
            firstError = msg;
            firstIsInput = input;
          }
        }
        shared.transport.abort(msg);
      }
      if (finished.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(finishedMu);
        allFinished.notify_one();
      }
    });
  }
  // Watchdog: the main thread watches the progress counter, every 5 ms of `clock`.
  uint64_t seen = shared.progress.load();
  double lastChange = clock.now();
  std::optional<double> abortedAt;
  // After an abort every rank thread returns at its next transport call, unless one is held
  // inside a device or library call that the abort cannot reach (a GPU launch queue full behind
  // a kernel that never finishes): the process then ends with the report, since joining would
  // wait forever.
  const double grace = std::max(2 * timeout, 10.0);
  while (finished.load() < n) {
    {
      std::unique_lock<std::mutex> lock(finishedMu);
      if (clock.waitUntil(lock, allFinished, clock.now() + 0.005,
                          [&] { return finished.load() == n; }))
        break;
    }
    if (shared.transport.aborted()) {
      if (!abortedAt)
        abortedAt = clock.now();
      else if (clock.now() - *abortedAt >= grace) {
        std::string report;
        {
          std::lock_guard<std::mutex> lock(mu);
          report = firstError;
        }
        fmt::print(stderr,
                   "{}\nwatchdog: {} of the {} rank threads did not stop {:.1f} s after the "
                   "report above (held inside a GPU or library call: a kernel that never "
                   "finishes?); exiting\n",
                   report, n - finished.load(), n, grace);
        std::fflush(stderr);
        std::_Exit(1); // (joining, or destructors, would wait for the call that holds them)
      }
    }
    uint64_t now = shared.progress.load();
    if (now != seen) {
      seen = now;
      lastChange = clock.now();
      continue;
    }
    double idle = clock.now() - lastChange;
    if (idle >= timeout && !shared.transport.aborted()) {
      std::string report = stallReport(idle, index);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (firstError.empty())
          firstError = report;
      }
      shared.transport.abort(report);
    }
  }
  for (auto &th : threads)
    th.join();
  if (firstError.empty())
    return llvm::Error::success();
  if (firstIsInput)
    return llvm::make_error<InputError>(firstError);
  return llvm::make_error<Finding>(firstError);
}

} // namespace pipec
