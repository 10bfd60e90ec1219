#include "tools/Args.h"

#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"
#include "ir/support/Memory.h"
#include "ir/support/Stdout.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cassert>
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
    std::fputs(fmt::format("{}: error: {}\n", tool.str(), printableMessage(oneLine(std::move(msg))))
                   .c_str(),
               stderr);
  else
    std::fputs(fmt::format("{}: {}\n", tool.str(), printableMessage(msg)).c_str(), stderr);
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

std::string shellWord(llvm::StringRef word) {
  auto plain = [](char c) { return llvm::isAlnum(c) || llvm::StringRef("_./:=,+@%-").contains(c); };
  if (!word.empty() && llvm::all_of(word, plain))
    return word.str();
  std::string out = "'";
  for (char c : word)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

llvm::Expected<Args> Args::parse(int argc, char **argv, int first, const Command &cmd,
                                 OptionUse caller) {
  const std::string prefix = cmd.errorPrefix();
  auto accepted = [&](llvm::StringRef name) -> const Option * {
    const Option *o = cmd.find(name);
    return o && o->shownIn(caller) ? o : nullptr;
  };
  Args a;
  a.cmd = &cmd;
  for (int i = first; i < argc; ++i) {
    llvm::StringRef arg = argv[i];
    if (!arg.startswith("-") || arg == "-") {
      a.pos.push_back(arg.str());
      continue;
    }
    auto [name, value] = arg.split('=');
    bool hasValue = arg.contains('=');
    const Option *o = accepted(name);
    if (!o) {
      std::string nearest;
      unsigned best = ~0u;
      for (const Option &f : cmd.options)
        for (const char *spelling : {f.name, f.alias})
          if (spelling && f.shownIn(caller))
            if (unsigned d = name.edit_distance(spelling); d < best)
              best = d, nearest = spelling;
      return inputError("{}unknown flag {}{}", prefix, name.str(),
                        nearest.empty() ? std::string()
                                        : fmt::format("; did you mean {}?", nearest));
    }
    if (o->isSwitch()) {
      if (hasValue)
        return inputError("{}{} takes no value (got '{}')", prefix, name.str(), value.str());
      a.values[o->name] = "1";
      continue;
    }
    if (!hasValue) {
      // The value left out and the next flag taken for it would be reported as the flag after
      // it being "unexpected" ('--schedule --pp 3' as '3'): a word that is one of this
      // command's flags is never a value.
      llvm::StringRef next = i + 1 < argc ? llvm::StringRef(argv[i + 1]) : llvm::StringRef();
      if (i + 1 >= argc || (next.startswith("-") && accepted(next.split('=').first)))
        return inputError("{}{} needs a value; give it as {} {}", prefix, name.str(), name.str(),
                          o->example ? o->example : o->value);
      value = argv[++i];
    }
    if (a.values.count(o->name))
      return inputError("{}{} given twice ('{}' and '{}'); give it once", prefix, name.str(),
                        shortened(a.values[o->name], 40), shortened(value, 40));
    a.values[o->name] = value.str();
  }
  return a;
}

llvm::Expected<Args> Args::parse(int argc, char **argv, int first,
                                 llvm::ArrayRef<llvm::StringRef> valued,
                                 llvm::ArrayRef<llvm::StringRef> switches,
                                 llvm::StringRef command) {
  // A table made on the spot: the flags' names outlive it (the callers' literals).
  std::vector<Option> options;
  for (llvm::StringRef f : valued)
    options.push_back(Option{f.data(), OptionKind::String, "VALUE", ""});
  for (llvm::StringRef f : switches)
    options.push_back(Option{f.data(), OptionKind::Switch, "", ""});
  const std::string name = command.str();
  Command cmd{"", name.c_str(), "", "", options};
  auto a = parse(argc, argv, first, cmd);
  if (a)
    a->cmd = nullptr;
  return a;
}

const Option &Args::option(llvm::StringRef flag, OptionKind kind) const {
  const Option *o = cmd ? cmd->find(flag) : nullptr;
  assert(o && o->kind == kind && "the flag is not in the command's table as that kind");
  (void)kind;
  return *o;
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
  if (s.getAsInteger(10, out)) {
    // Digits past int64's range: an integer, only too large (or too small) for the flag.
    llvm::StringRef digits = s;
    const bool negative = digits.consume_front("-");
    if (!digits.empty() && llvm::all_of(digits, llvm::isDigit))
      return negative ? inputError("{} must be at least {} (got {}); try {} {}", flag.str(), min,
                                   shortened(s, 40), flag.str(), min)
                      : inputError("{} must be at most {} (got {}); try {} {}", flag.str(), max,
                                   shortened(s, 40), flag.str(), max);
    return inputError("{} expects an integer (got '{}'); try {} {}", flag.str(), *v, flag.str(),
                      std::max(min, fallback));
  }
  if (out < min)
    return inputError("{} must be at least {} (got {}); try {} {}", flag.str(), min, out,
                      flag.str(), min);
  if (out > max)
    return inputError("{} must be at most {} (got {}); try {} {}", flag.str(), max, out, flag.str(),
                      max);
  return out;
}

llvm::Expected<int64_t> Args::integer(llvm::StringRef flag) const {
  const Option &o = option(flag, OptionKind::Int);
  return integer(flag, o.fallback, o.min, o.max);
}

llvm::Expected<std::optional<double>> Args::real(llvm::StringRef flag) const {
  const Option &o = option(flag, OptionKind::Double);
  auto v = get(flag);
  if (!v)
    return std::nullopt;
  double d = 0;
  if (llvm::StringRef(*v).getAsDouble(d) || !(d > 0) || (o.max > 0 && d > double(o.max)))
    return inputError("{} expects a positive number{} such as {} (got '{}')", flag.str(),
                      o.max > 0 ? fmt::format(" up to {}", o.max) : std::string(),
                      o.example ? o.example : "1", *v);
  return d;
}

/// An Enum option's choices: "a|b|c" split.
static llvm::SmallVector<llvm::StringRef, 4> choicesOf(const Option &o) {
  llvm::SmallVector<llvm::StringRef, 4> out;
  llvm::StringRef(o.value).split(out, '|');
  return out;
}

bool Args::isChoice(llvm::StringRef flag, llvm::StringRef value) const {
  return llvm::is_contained(choicesOf(option(flag, OptionKind::Enum)), value);
}

llvm::Expected<std::optional<std::string>> Args::choice(llvm::StringRef flag) const {
  const Option &o = option(flag, OptionKind::Enum);
  auto v = get(flag);
  if (!v || isChoice(flag, *v))
    return v;
  auto all = choicesOf(o);
  std::string listed = llvm::join(all.begin(), all.end() - 1, ", ") + " or " + all.back().str();
  return inputError("{}: expected {} (got '{}'); try {} {}", flag.str(), listed, *v, flag.str(),
                    o.example ? llvm::StringRef(o.example) : all.front());
}

llvm::Expected<std::vector<int64_t>> Args::integers(llvm::StringRef flag) const {
  option(flag, OptionKind::IntList);
  std::vector<int64_t> out;
  auto v = get(flag);
  if (!v)
    return out;
  llvm::SmallVector<llvm::StringRef, 8> parts;
  // (Empty parts kept: "2,,4" is a typo, refused, not the list 2,4.)
  llvm::StringRef(*v).split(parts, ',', -1, true);
  for (llvm::StringRef p : parts) {
    int64_t x = 0;
    if (p.trim().getAsInteger(10, x) || x < 1 || x > kMaxFlagCount)
      return inputError("{} expects a comma-separated list of positive integers such as 1,2,4 "
                        "(got '{}')",
                        flag.str(), *v);
    out.push_back(x);
  }
  if (out.empty())
    return inputError("{} expects at least one value such as 1,2,4", flag.str());
  return out;
}

llvm::Expected<std::vector<std::string>> Args::words(llvm::StringRef flag) const {
  const Option &o = option(flag, OptionKind::StringList);
  std::vector<std::string> out;
  auto v = get(flag);
  if (!v)
    return out;
  llvm::SmallVector<llvm::StringRef, 8> parts;
  llvm::StringRef(*v).split(parts, ',', -1, true);
  for (llvm::StringRef p : parts) {
    if (p.trim().empty())
      return inputError("{}: an empty entry in '{}'; expected a comma-separated list such as {}",
                        flag.str(), *v, o.example ? o.example : o.value);
    out.push_back(p.trim().str());
  }
  if (out.empty())
    return inputError("{} expects a comma-separated list such as {}", flag.str(),
                      o.example ? o.example : o.value);
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
  // A count of bytes is whole: "1.5" is a slip (a unit left out?), not 2 bytes.
  bad |= factor == 1 && value != std::floor(value);
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
