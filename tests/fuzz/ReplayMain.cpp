//===- ReplayMain.cpp - Run a fuzz target on files, without libFuzzer ----===//
//
// The normal (gcc) build's main for the fuzz targets: every argument that is a file is one
// input, a directory gives each of its files; arguments starting with '-' (libFuzzer's flags)
// are ignored. Prints how many inputs ran; any crash fails the test.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include <algorithm>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <iterator>
#include <string>
#include <sys/stat.h>
#include <vector>

static bool isDirectory(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

static void collect(const std::string &path, std::vector<std::string> &files) {
  if (!isDirectory(path)) {
    files.push_back(path);
    return;
  }
  DIR *d = ::opendir(path.c_str());
  if (!d)
    return;
  std::vector<std::string> names;
  while (struct dirent *e = ::readdir(d))
    if (e->d_name[0] != '.')
      names.push_back(path + "/" + e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string &n : names)
    collect(n, files);
}

int main(int argc, char **argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-')
      collect(argv[i], files);
  for (const std::string &f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "replay: cannot read %s\n", f.c_str());
      return 1;
    }
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size());
  }
  std::printf("replayed %zu inputs\n", files.size());
  return files.empty() ? 1 : 0;
}
