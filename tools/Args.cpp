#include "tools/Args.h"

#include "ir/Files.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <system_error>

namespace pipec {

/// A bad-input message as one line of bounded length: every run of more than 160 characters
/// without a space (a pasted value, a path) shortened, and the line to at most 4000 characters.
static std::string oneLine(std::string msg) {
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  std::replace(msg.begin(), msg.end(), '\r', ' ');
  std::string out;
  size_t i = 0;
  while (i < msg.size()) {
    size_t end = msg.find(' ', i);
    if (end == std::string::npos)
      end = msg.size();
    llvm::StringRef word(msg.data() + i, end - i);
    out += word.size() > 160 ? shortened(word, 120) : word.str();
    if (end < msg.size())
      out += ' ';
    i = end + 1;
  }
  return out.size() > 4000 ? shortened(out, 4000) : out;
}

int reportError(llvm::StringRef tool, llvm::Error err) {
  int code = exitCodeFor(err);
  std::string msg = takeMessage(std::move(err));
  // (fputs, not fmt::print: a failing stderr must not throw from here)
  if (code == 2)
    std::fputs(fmt::format("{}: error: {}\n", tool.str(), oneLine(std::move(msg))).c_str(),
               stderr);
  else
    std::fputs(fmt::format("{}: {}\n", tool.str(), msg).c_str(), stderr);
  return code;
}

int finishTool(llvm::StringRef tool, llvm::Error err) {
  if (err)
    return reportError(tool, std::move(err));
  if (auto lost = finishStdout())
    return reportError(tool, std::move(lost));
  return 0;
}

int runTool(llvm::StringRef tool, llvm::function_ref<llvm::Error()> body) {
  llvm::Error err = llvm::Error::success();
  try {
    err = body();
  } catch (const std::bad_alloc &) {
    err = inputError("out of memory: an allocation failed (this machine's memory is {}); try "
                     "smaller sizes",
                     humanBytes(memoryBudgetBytes()));
  } catch (const std::system_error &e) {
    // fmt reports a failed write to standard output so.
    err = inputError("standard output: cannot write: {}", e.code().message());
  } catch (const std::exception &e) {
    err = inputError("unexpected failure: {}", e.what());
  }
  return finishTool(tool, std::move(err));
}

std::string userPath(llvm::StringRef path) {
  const char *cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (!cwd || path.empty() || llvm::sys::path::is_absolute(path) || path == "-")
    return path.str();
  llvm::SmallString<256> full(cwd);
  llvm::sys::path::append(full, path);
  return std::string(full);
}

llvm::Expected<Args> Args::parse(int argc, char **argv, int first,
                                 llvm::ArrayRef<llvm::StringRef> valued,
                                 llvm::ArrayRef<llvm::StringRef> switches,
                                 llvm::StringRef command) {
  const std::string prefix = command.empty() ? std::string() : command.str() + ": ";
  Args a;
  for (int i = first; i < argc; ++i) {
    llvm::StringRef arg = argv[i];
    if (!arg.startswith("-") || arg == "-") {
      a.pos.push_back(arg.str());
      continue;
    }
    auto [name, value] = arg.split('=');
    bool hasValue = arg.contains('=');
    if (llvm::is_contained(switches, name)) {
      if (hasValue)
        return inputError("{}{} takes no value (got '{}')", prefix, name.str(), value.str());
      a.values[name.str()] = "1";
      continue;
    }
    if (!llvm::is_contained(valued, name)) {
      std::string nearest;
      unsigned best = ~0u;
      for (llvm::StringRef f : valued)
        if (unsigned d = name.edit_distance(f); d < best)
          best = d, nearest = f.str();
      for (llvm::StringRef f : switches)
        if (unsigned d = name.edit_distance(f); d < best)
          best = d, nearest = f.str();
      return inputError("{}unknown flag {}{}", prefix, name.str(),
                        nearest.empty() ? std::string()
                                        : fmt::format("; did you mean {}?", nearest));
    }
    if (!hasValue) {
      if (i + 1 >= argc)
        return inputError("{}{} needs a value", prefix, name.str());
      value = argv[++i];
    }
    if (a.values.count(name.str()))
      return inputError("{}{} given twice", prefix, name.str());
    a.values[name.str()] = value.str();
  }
  return a;
}

std::optional<std::string> Args::get(llvm::StringRef flag) const {
  auto it = values.find(flag.str());
  if (it == values.end())
    return std::nullopt;
  return it->second;
}

llvm::Expected<std::string> Args::required(llvm::StringRef flag) const {
  auto v = get(flag);
  if (!v)
    return inputError("missing {} (required)", flag.str());
  return *v;
}

llvm::Expected<int64_t> Args::integer(llvm::StringRef flag, int64_t fallback, int64_t min,
                                      int64_t max) const {
  auto v = get(flag);
  if (!v)
    return fallback;
  llvm::StringRef s(*v);
  int64_t out = 0;
  if (s.getAsInteger(10, out))
    return inputError("{} expects an integer (got '{}'); try {}", flag.str(), *v,
                      std::max(min, fallback));
  if (out < min)
    return inputError("{} must be at least {} (got {}); try {}", flag.str(), min, out, min);
  if (out > max)
    return inputError("{} must be at most {} (got {}); try {}", flag.str(), max, out, max);
  return out;
}

llvm::Expected<int64_t> Args::bytes(llvm::StringRef flag) const {
  auto v = get(flag);
  if (!v)
    return int64_t(0);
  llvm::StringRef s = llvm::StringRef(*v).trim();
  size_t n = 0;
  while (n < s.size() && (llvm::isDigit(s[n]) || s[n] == '.'))
    ++n;
  llvm::StringRef num = s.take_front(n), unit = s.drop_front(n).trim();
  double value = 0;
  bool bad = num.empty() || num.getAsDouble(value);
  struct Unit {
    const char *name;
    double factor;
  } units[] = {{"", 1},
               {"B", 1},
               {"KB", 1e3},
               {"MB", 1e6},
               {"GB", 1e9},
               {"TB", 1e12},
               {"KiB", 1024.0},
               {"MiB", 1048576.0},
               {"GiB", 1073741824.0},
               {"TiB", 1099511627776.0}};
  double factor = -1;
  for (const Unit &u : units)
    if (unit.equals_insensitive(u.name))
      factor = u.factor;
  if (bad || factor < 0 || value * factor < 1 || value * factor > 9e18)
    return inputError("{} expects a positive byte count such as 85899345920 or 80GiB (got "
                      "'{}')",
                      flag.str(), *v);
  return int64_t(std::llround(value * factor));
}

std::optional<std::string> Args::path(llvm::StringRef flag) const {
  auto v = get(flag);
  if (!v)
    return std::nullopt;
  return userPath(*v);
}

} // namespace pipec
