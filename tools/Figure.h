//===- Figure.h - The papers' schedule figure, as SVG -----------*- C++ -*-===//
//
// The figure the pipeline papers draw (GPipe, 1F1B, zero bubble, DualPipe): one row per
// pipeline rank over simulated time, one box per compute op (each part of a tp-split op)
// from its simulated start to its end, coloured by kind (F, fused B, I, W; a DualPipeV
// overlapped F&B pair in a colour of its own, outlined), later chunks of a rank (interleaved
// and V-shape schedules) in a lighter shade, each labelled with its microbatch (and `.slice`
// with sub-sequences) where it fits, and with a tooltip naming the op and its times. tp
// all-reduces (they occupy the rank) are grey boxes; dp and embedding all-reduces a thin bar
// under their rank's row, on their own stream; every cross-rank transfer a line from its
// producer's end to its arrival. Idle time shows as the grey row behind the boxes: the bubble.
// A time axis in the plan's unit and a legend of the kinds present close the figure.
//
// Boxes carry data-rank, data-step, data-start and data-end (the instruction and its
// simulated times) and the root element the mapping from time to x (data-time-x0 and
// data-px-per-time), so that a test can check the drawing against the simulator.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_FIGURE_H
#define PIPEC_TOOLS_FIGURE_H

#include "ir/CostModel.h"
#include "ir/Plan.h"

#include <string>

namespace pipec {

/// Whether compute op `step` of rank `rank` is the forward of a DualPipeV-style overlapped
/// F&B pair: in a V-shape plan, a forward whose next compute op on the rank (comms between
/// aside) is a fused backward of the rank's other chunk. DualPipeV runs exactly its steady
/// state's F0&B1 and F1&B0 that way; no other schedule in pipec emits that pattern.
bool startsOverlappedPair(const Plan &plan, int rank, size_t step);

/// The figure of `plan` over `timeline` (simulateTimeline's), as a standalone SVG document.
std::string scheduleSvg(const Plan &plan, const Timeline &timeline);

} // namespace pipec

#endif // PIPEC_TOOLS_FIGURE_H
