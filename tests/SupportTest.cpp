// ir/support: the hash against the published FNV-1a test vectors, byte counts, and the durable
// writer's promises (the destination whole or untouched, no temporary left, no link followed).
#include "ir/support/Bytes.h"
#include "ir/support/DurableFile.h"
#include "ir/support/Error.h"
#include "ir/support/Hash.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace pipec {
namespace {

// The 64-bit FNV-1a vectors of the reference implementation's test suite (Fowler, Noll, Vo:
// test_fnv.c, fnv1a_64 of "", "a", "foobar").
TEST(Hash, MatchesTheReferenceVectors) {
  EXPECT_EQ(fnv1a(llvm::StringRef("")), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a(llvm::StringRef("a")), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a(llvm::StringRef("foobar")), 0x85944171f73967e8ULL);
}

TEST(Hash, PiecesContinueTheWhole) {
  EXPECT_EQ(fnv1a(llvm::StringRef("bar"), fnv1a(llvm::StringRef("foo"))),
            fnv1a(llvm::StringRef("foobar")));
}

// SplitMix64 as its authors' reference (Vigna's splitmix64.c) generates: the state advances by
// the golden gamma before each output, so output i of seed s is splitMix64(s + i * gamma).
TEST(Hash, SplitMix64MatchesTheReferenceGenerator) {
  constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;
  EXPECT_EQ(splitMix64(0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(splitMix64(1234567), 6457827717110365317ULL);
  EXPECT_EQ(splitMix64(1234567 + kGamma), 3203168211198807973ULL);
}

TEST(Bytes, TheUnitFollowsTheSize) {
  EXPECT_EQ(humanBytes(uint64_t(0)), "0 B");
  EXPECT_EQ(humanBytes(uint64_t(1023)), "1023 B");
  EXPECT_EQ(humanBytes(uint64_t(1536)), "1.50 KiB");
  EXPECT_EQ(humanBytes(uint64_t(3) << 29), "1.50 GiB");
  EXPECT_EQ(humanBytes(int64_t(-1536)), "-1.50 KiB");
  EXPECT_EQ(humanBytes(INT64_MIN), "-8.00 EiB");
  EXPECT_EQ(humanBytes(UINT64_MAX), "16.00 EiB");
  // One unit for a column: GiB whatever the size, in humanBytes' style.
  EXPECT_EQ(inGiB(int64_t(3) << 29), "1.50 GiB");
  EXPECT_EQ(inGiB(int64_t(1) << 28), "0.25 GiB");
  EXPECT_EQ(inGiB(int64_t(3) << 40), "3072.00 GiB");
  EXPECT_EQ(inGiB(-(int64_t(3) << 29)), "-1.50 GiB");
  EXPECT_DOUBLE_EQ(inMiB(uint64_t(3) << 19), 1.5);
  EXPECT_EQ(mibColumns({uint64_t(1) << 20, uint64_t(1) << 19}), "1.00 0.50");
  EXPECT_EQ(mibColumns({}), "");
}

/// A fresh directory of this test's own.
std::string freshDir(const std::string &name) {
  std::string dir = ::testing::TempDir() + "/support-" + name;
  std::string cmd = "rm -rf '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0);
  return dir;
}

std::vector<std::string> entries(const std::string &dir) {
  std::vector<std::string> names;
  DIR *d = ::opendir(dir.c_str());
  while (struct dirent *e = d ? ::readdir(d) : nullptr)
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..")
      names.push_back(e->d_name);
  if (d)
    ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string contents(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int kills = 0;
void countKill() { ++kills; }

TEST(DurableFile, ReplacesTheFileWholeAndReportsTheDigestOfItsBytes) {
  const std::string dir = freshDir("replace");
  { std::ofstream(dir + "/out") << "old"; }
  int dirFd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(dirFd, 0);
  // Larger than the stream's buffer, in pieces, so that the digest spans several writes.
  const std::string big(200000, 'x');
  uint64_t digest = 0;
  kills = 0;
  ASSERT_FALSE(bool(writeDurablyAt(
      dirFd, "out", "out",
      [&](llvm::raw_ostream &os) {
        os << "head;";
        os.flush();
        os << big;
      },
      &digest, countKill)));
  EXPECT_EQ(contents(dir + "/out"), "head;" + big);
  EXPECT_EQ(digest, fnv1a(llvm::StringRef("head;" + big)));
  EXPECT_EQ(entries(dir), std::vector<std::string>{"out"});
  // Before the temporary, after its bytes, before and after the rename.
  EXPECT_EQ(kills, 4);
  EXPECT_FALSE(bool(syncDirectory(dirFd, dir)));
  ::close(dirFd);
}

TEST(DurableFile, AFailedRenameLeavesNeitherTheDestinationChangedNorATemporary) {
  const std::string dir = freshDir("failed");
  ASSERT_EQ(::mkdir((dir + "/out").c_str(), 0755), 0);
  { std::ofstream(dir + "/out/keep") << "kept"; }
  llvm::Error err =
      writeDurablyAt(AT_FDCWD, dir + "/out", "OUT", [](llvm::raw_ostream &os) { os << "new"; });
  ASSERT_TRUE(bool(err));
  EXPECT_EQ(takeMessage(std::move(err)).rfind("OUT: cannot write: ", 0), 0u);
  EXPECT_EQ(entries(dir), std::vector<std::string>{"out"});
  EXPECT_EQ(contents(dir + "/out/keep"), "kept");
}

TEST(DurableFile, TheTemporaryIsNewAndBesideTheDestination) {
  const std::string dir = freshDir("temporary");
  int dirFd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(dirFd, 0);
  auto tmp =
      writeTemporaryAt(dirFd, "file.json", "file.json", [](llvm::raw_ostream &os) { os << "{}"; });
  ASSERT_TRUE(bool(tmp)) << takeMessage(tmp.takeError());
  llvm::StringRef name = tmp->name;
  EXPECT_TRUE(name.consume_front("file.json.tmp-"));
  EXPECT_EQ(name.size(), 6u);
  EXPECT_EQ(entries(dir), std::vector<std::string>{tmp->name});
  EXPECT_EQ(contents(dir + "/" + tmp->name), "{}");
  discardTemporaryAt(dirFd, *tmp);
  EXPECT_TRUE(entries(dir).empty());
  ::close(dirFd);
}

TEST(DurableFile, ASymbolicLinkAtTheDestinationIsReplacedNotFollowed) {
  const std::string dir = freshDir("link");
  { std::ofstream(dir + "/target") << "target"; }
  ASSERT_EQ(::symlink("target", (dir + "/out").c_str()), 0);
  int dirFd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(dirFd, 0);
  ASSERT_FALSE(
      bool(writeDurablyAt(dirFd, "out", "out", [](llvm::raw_ostream &os) { os << "written"; })));
  struct stat st;
  ASSERT_EQ(::lstat((dir + "/out").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(contents(dir + "/out"), "written");
  EXPECT_EQ(contents(dir + "/target"), "target");
  ::close(dirFd);
}

} // namespace
} // namespace pipec
