#include "ir/Error.h"

#include "llvm/Support/raw_ostream.h"

namespace pipec {

char InputError::ID = 0;
char Finding::ID = 0;

void InputError::log(llvm::raw_ostream &os) const { os << msg; }
void Finding::log(llvm::raw_ostream &os) const { os << msg; }

int exitCodeFor(const llvm::Error &err) { return err.isA<Finding>() ? 1 : 2; }

std::string takeMessage(llvm::Error err) { return llvm::toString(std::move(err)); }

} // namespace pipec
