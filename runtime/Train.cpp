#include "runtime/Train.h"

#include "runtime/HfExport.h"

#include "ir/support/Error.h"

#include <chrono>
#include <memory>

namespace pipec {

TrainBackend::~TrainBackend() = default;

namespace {

/// --init-from's weights, checked against the model (every layer, whole).
llvm::Error checkInitialWeights(const std::vector<std::vector<float>> &layers,
                                const kernels::GptConfig &cfg) {
  if (layers.size() != size_t(cfg.numLayers()))
    return inputError("--init-from: {} layers of weights for a model of {}", layers.size(),
                      cfg.numLayers());
  for (int l = 0; l < cfg.numLayers(); ++l)
    if (layers[size_t(l)].size() != kernels::layerParamCount(cfg, l, 1))
      return inputError("--init-from: layer {} holds {} weights, the model's has {}", l,
                        layers[size_t(l)].size(), kernels::layerParamCount(cfg, l, 1));
  return llvm::Error::success();
}

/// The run's first weights into the backend's ranks and the reference: --init-from's, or a
/// checkpoint's with its optimizer state (each process reads the layers it holds, the lead all
/// of them when it runs the reference).
llvm::Error loadFirstState(const kernels::GptConfig &cfg, TrainBackend &backend,
                           const TrainOptions &options, ReferenceRun *ref) {
  if (options.initWeights) {
    if (auto err = checkInitialWeights(*options.initWeights, cfg))
      return err;
    LayerState whole;
    for (int l = 0; l < cfg.numLayers(); ++l) {
      whole.weights = (*options.initWeights)[size_t(l)];
      if (backend.holdsLayer(l))
        if (auto err = backend.scatterLayer(l, whole))
          return err;
      if (ref)
        loadLayerState(ref->stage(), cfg, l, 0, 1, whole);
    }
  }
  if (!options.resume)
    return llvm::Error::success();
  const Checkpoint &ckpt = *options.resume;
  LayerState whole;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    if (!backend.holdsLayer(l) && !ref)
      continue;
    if (auto err = readCheckpointLayer(ckpt, l, whole))
      return err;
    if (whole.weights.size() != kernels::layerParamCount(cfg, l, 1))
      return inputError("--resume: {}: layer {} holds {} weights, the model's has {}", ckpt.path, l,
                        whole.weights.size(), kernels::layerParamCount(cfg, l, 1));
    if (backend.holdsLayer(l))
      if (auto err = backend.scatterLayer(l, whole))
        return err;
    if (ref)
      loadLayerState(ref->stage(), cfg, l, 0, 1, whole);
  }
  backend.setAdamSteps(int(ckpt.manifest.adamSteps));
  if (ref)
    ref->stage().setAdamSteps(int(ckpt.manifest.adamSteps));
  return llvm::Error::success();
}

/// The checkpoint after `stepsDone` steps: every layer whole, gathered from the backend (every
/// process takes part; the lead writes).
llvm::Error saveState(const Plan &plan, const kernels::GptConfig &cfg, TrainBackend &backend,
                      const TrainOptions &options, int stepsDone, SavedCheckpoint &saved) {
  if (!backend.leads()) {
    LayerState unused;
    for (int l = 0; l < cfg.numLayers(); ++l)
      if (auto err = backend.gatherLayer(l, unused))
        return err;
    return llvm::Error::success();
  }
  const ParallelConfig &pc = plan.parallel;
  CheckpointManifest m;
  m.step = stepsDone;
  m.adamSteps = backend.adamSteps();
  m.seed = options.seed;
  m.sequences =
      uint64_t(stepsDone) * uint64_t(pc.dp) * uint64_t(pc.microbatches) * uint64_t(cfg.microbatch);
  m.data = options.dataName;
  m.lr = options.lr;
  m.modelName = plan.model;
  m.model = *plan.transformer;
  m.schedule = plan.schedule;
  m.parallel = pc;
  m.planHash = planHash(plan);
  for (int l = 0; l < cfg.numLayers(); ++l) // (the sizes, for a full disk's message)
    m.layers.push_back({0, kernels::layerParamCount(cfg, l, 1), ""});
  return saveCheckpoint(
      options.saveDir, m,
      [&](int l, LayerState &out) {
        const size_t whole = kernels::layerParamCount(cfg, l, 1);
        out.weights.assign(whole, 0.0f);
        out.firstMoment.assign(whole, 0.0f);
        out.secondMoment.assign(whole, 0.0f);
        return backend.gatherLayer(l, out);
      },
      options.keep, &saved);
}

/// --export-hf: every layer's weights whole, gathered from the backend (every process takes
/// part), written by the lead as a Hugging Face directory.
llvm::Error exportWeights(const Plan &plan, const kernels::GptConfig &cfg, TrainBackend &backend,
                          const TrainOptions &options) {
  std::vector<std::vector<float>> layers(size_t(cfg.numLayers()));
  LayerState state;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    const size_t whole = kernels::layerParamCount(cfg, l, 1);
    state.weights.assign(whole, 0.0f);
    state.firstMoment.assign(whole, 0.0f);
    state.secondMoment.assign(whole, 0.0f);
    if (auto err = backend.gatherLayer(l, state))
      return err;
    layers[size_t(l)] = std::move(state.weights);
  }
  if (!backend.leads())
    return llvm::Error::success();
  auto files = writeHfDirectory(options.exportHfDir, cfg, *plan.transformer, layers,
                                options.exportHfShardBytes ? options.exportHfShardBytes
                                                           : kDefaultHfShardBytes);
  if (!files)
    return files.takeError();
  if (options.onExported)
    options.onExported(options.exportHfDir, *files);
  return llvm::Error::success();
}

} // namespace

llvm::Expected<TrainResult> train(const Plan &plan, const kernels::GptConfig &cfg,
                                  const DataSource &data, TrainBackend &backend,
                                  const TrainOptions &options,
                                  const std::function<void(int, double)> &onStep) {
  if (auto err = backend.setUp())
    return err;
  // The single-rank reference, on the lead process.
  std::unique_ptr<ReferenceRun> ref;
  if (options.checkReference && backend.leads())
    ref = std::make_unique<ReferenceRun>(plan, cfg, data, options.seed, options.lr);
  if (auto err = loadFirstState(cfg, backend, options, ref.get()))
    return err;
  if (options.checkReference) {
    if (ref && options.onReferenceBuilt)
      options.onReferenceBuilt();
    if (auto err = backend.referenceStepDone()) // (the others wait for it here, not in step 0)
      return err;
  }
  const int first = options.resume ? int(options.resume->manifest.step) : 0;
  TrainResult result;
  for (int s = first; s < first + options.steps; ++s) {
    const auto started = std::chrono::steady_clock::now();
    auto loss = backend.step(s);
    if (!loss)
      return loss.takeError();
    result.stepMs.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
            .count());
    result.losses.push_back(*loss);
    if (options.checkReference) {
      ParamSnapshot grads;
      if (auto err = backend.takeGradients(grads))
        return err;
      if (ref) {
        result.referenceLosses.push_back(ref->step(s));
        ref->compare(grads, result.grads, s);
        result.lastGrads = grads.byStageAndTp;
        ref->adopt(grads); // ReferenceRun::adopt: the next step starts from the run's weights
        ref->update();
      }
      if (auto err = backend.referenceStepDone())
        return err;
    }
    if (onStep && backend.leads())
      onStep(s, *loss);
    // Preemption: every process stops after the same step (a signal during the last one
    // changes nothing: the run is done).
    int stop = 0;
    if (options.stopSignal && s + 1 < first + options.steps) {
      auto agreed = backend.agreeOnStop(options.stopSignal->load());
      if (!agreed)
        return agreed.takeError();
      stop = *agreed;
    }
    const bool last = stop || s + 1 == first + options.steps;
    if (!options.saveDir.empty() &&
        (last || (options.saveEvery > 0 && (s + 1) % options.saveEvery == 0))) {
      const auto started = std::chrono::steady_clock::now();
      SavedCheckpoint saved;
      if (auto err = saveState(plan, cfg, backend, options, s + 1, saved))
        return err;
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
      if (options.onSaved && backend.leads())
        options.onSaved(s + 1, checkpointPath(options.saveDir, s + 1), saved, took.count());
    }
    if (stop) { // (no weight check, no export: the job is not done)
      result.stopSignal = stop;
      result.stoppedAt = s + 1;
      backend.finish();
      return result;
    }
  }
  if (options.checkReference && options.steps > 0) {
    ParamSnapshot weights;
    if (auto err = backend.snapshotWeights(weights))
      return err;
    if (ref)
      result.weights = ref->compareWeights(weights, options.steps);
  }
  if (options.profile) {
    MeasuredCosts costs;
    if (auto err = backend.measuredCosts(costs))
      return err;
    costs.planHash = planHash(plan);
    costs.steps = int(result.stepMs.size());
    if (backend.leads())
      result.costs = std::move(costs);
  }
  if (!options.exportHfDir.empty())
    if (auto err = exportWeights(plan, cfg, backend, options))
      return err;
  backend.finish();
  return result;
}

} // namespace pipec
