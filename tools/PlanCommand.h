//===- PlanCommand.h - pipec plan -------------------------------*- C++ -*-===//
#ifndef PIPEC_TOOLS_PLANCOMMAND_H
#define PIPEC_TOOLS_PLANCOMMAND_H

#include "llvm/Support/Error.h"

namespace pipec {

/// pipec plan --model M.json --gpus N --global-batch B [...] (argv[1] is "plan").
llvm::Error runPlanCommand(int argc, char **argv);

} // namespace pipec

#endif // PIPEC_TOOLS_PLANCOMMAND_H
