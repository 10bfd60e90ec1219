//===- Bytes.h - Byte counts as people read them ----------------*- C++ -*-===//
//
// Every size a message or a report prints goes through these: humanBytes where the unit
// follows the size ("1.50 GiB"), inGiB where a table's column is in GiB throughout, inMiB where
// a column or a message is in MiB throughout.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_BYTES_H
#define PIPEC_IR_SUPPORT_BYTES_H

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <string>

namespace pipec {

/// "512 B", "1.50 KiB", "1.50 GiB": the largest binary unit the count reaches, two decimals.
std::string humanBytes(uint64_t bytes);
/// The same for a signed count ("-1.50 GiB").
std::string humanBytes(int64_t bytes);

/// `bytes` in GiB, two decimals, whatever its size ("73.84 GiB", "0.25 GiB", "-1.50 GiB"):
/// humanBytes' style in one unit, for a column whose rows compare at a glance.
std::string inGiB(int64_t bytes);

/// `bytes` in mebibytes, for messages and columns whose unit is MiB.
inline double inMiB(uint64_t bytes) { return double(bytes) / double(uint64_t(1) << 20); }
/// Sizes in MiB, two decimals each, separated by spaces ("1.00 0.50"): a column per rank.
std::string mibColumns(llvm::ArrayRef<uint64_t> sizes);

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_BYTES_H
