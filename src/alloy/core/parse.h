#pragma once
// A whole string as one number: the readers of config values, flag values and cluster files all
// need "this text is exactly a number", which std::stod / std::stoll alone do not say (they stop
// at the first character that does not fit and throw on none).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace alloy {

// TEXT as a number (std::stod's syntax, nothing after it; inf and nan included: callers that need
// a finite value check), or nullopt.
inline std::optional<double> parse_double(const std::string& text) {
  size_t used = 0;
  try {
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::logic_error&) {
  }
  return std::nullopt;
}

// TEXT as a 64-bit integer (std::stoll's syntax, nothing after it), or nullopt.
inline std::optional<int64_t> parse_int64(const std::string& text) {
  size_t used = 0;
  try {
    const long long v = std::stoll(text, &used);
    if (used == text.size()) return static_cast<int64_t>(v);
  } catch (const std::logic_error&) {
  }
  return std::nullopt;
}

}  // namespace alloy
