#pragma once
// Lists as text, for messages, variables and file names.
#include <string>
#include <type_traits>
#include <vector>

namespace alloy {

// ITEMS (numbers or strings) with SEP between them: join({0, 2}, ",") = "0,2".
template <typename T>
std::string join(const std::vector<T>& items, const std::string& sep = ",") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    if constexpr (std::is_arithmetic_v<T>) out += std::to_string(items[i]);
    else out += items[i];
  }
  return out;
}

}  // namespace alloy
