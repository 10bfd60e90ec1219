#include "ir/support/Memory.h"

#include "ir/support/Bytes.h"
#include "ir/support/Error.h"

#include <algorithm>
#include <fstream>
#include <sys/resource.h>
#include <unistd.h>

namespace pipec {

uint64_t memoryBudgetBytes() {
  uint64_t budget = uint64_t(::sysconf(_SC_PHYS_PAGES)) * uint64_t(::sysconf(_SC_PAGESIZE));
  // A container's limit (cgroup v2, then v1).
  for (const char *file :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(file);
    uint64_t limit = 0;
    if (in >> limit && limit > 0)
      budget = std::min(budget, limit);
  }
  for (int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit rl;
    if (::getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
      budget = std::min<uint64_t>(budget, uint64_t(rl.rlim_cur));
  }
  return budget;
}

llvm::Error checkMemoryBudget(uint64_t bytes, llvm::StringRef what, llvm::StringRef fix) {
  const uint64_t budget = memoryBudgetBytes();
  if (bytes <= budget)
    return llvm::Error::success();
  return inputError("{} needs about {} of memory, more than this machine's {}{}{}", what.str(),
                    humanBytes(bytes), humanBytes(budget), fix.empty() ? "" : "; ", fix.str());
}

} // namespace pipec
