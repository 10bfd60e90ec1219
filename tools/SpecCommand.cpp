//===- SpecCommand.cpp - pipec spec: a model spec from a Hugging Face config ------===//
//
// The pipemodel/1 spec of a Hugging Face causal LM (GPT-2, Llama, Mistral) from its
// config.json (ir/formats/HfConfig.h), so that pipec plans, and piperun trains, the model a
// checkpoint directory holds. The sequence defaults to the config's context; the spec reads back to
// the same model (parseModelSpec), and piperun --init-from DIR checks it against the same config.
//
//===----------------------------------------------------------------------===//
#include "tools/SpecCommand.h"

#include "ir/formats/HfConfig.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Stdout.h"
#include "tools/Args.h"
#include "tools/Options.h"

#include "llvm/Support/Path.h"

#include <fmt/format.h>

namespace pipec {

llvm::Error runSpecCommand(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("spec"));
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("spec: unexpected argument '{}'; give the config as --from-hf "
                      "config.json",
                      shortened(args->positional().front(), 200));
  auto config = args->path("--from-hf");
  if (!config)
    return inputError("spec: --from-hf config.json is required (a Hugging Face model's "
                      "config.json)");
  auto hf = loadHfConfig(*config);
  if (!hf) // (named as --model's and --cluster's errors are)
    return inputError("--from-hf: {}", takeMessage(hf.takeError()));
  auto seq = args->integer("--seq-length");
  if (!seq)
    return seq.takeError();
  auto batch = args->integer("--microbatch-size");
  if (!batch)
    return batch.takeError();
  if (args->get("--name") == "")
    return inputError("--name: expected a name, got an empty one (leave --name out for the "
                      "config's directory name)");
  std::string name = args->get("--name").value_or(hfDefaultName(*hf, *config));
  auto text = hfModelSpecJson(*hf, name, *seq, *batch, *config);
  if (!text)
    return inputError("spec: {}", takeMessage(text.takeError()));
  if (auto out = args->path("-o")) {
    const std::vector<InputFile> inputs{{"--from-hf", *config}};
    if (auto err = writeFilesAtomically({OutputFile{"-o", *out, *text}}, inputs))
      return err;
    if (*out != "-") // (the spec alone on standard output)
      fmt::print("wrote {}\n", *args->get("-o"));
    return llvm::Error::success();
  }
  return writeStdout(*text);
}

} // namespace pipec
