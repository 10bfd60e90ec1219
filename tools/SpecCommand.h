//===- SpecCommand.h - pipec spec -------------------------------*- C++ -*-===//
#ifndef PIPEC_TOOLS_SPECCOMMAND_H
#define PIPEC_TOOLS_SPECCOMMAND_H

#include "llvm/Support/Error.h"

namespace pipec {

/// pipec spec --from-hf config.json [--seq-length T] [--microbatch-size B] [--name N]
/// [-o spec.json] (argv[1] is "spec").
llvm::Error runSpecCommand(int argc, char **argv);

} // namespace pipec

#endif // PIPEC_TOOLS_SPECCOMMAND_H
