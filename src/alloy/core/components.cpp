#include "alloy/core/components.h"

namespace alloy {

std::vector<std::vector<size_t>> components(size_t n, const std::function<bool(size_t, size_t)>& joined) {
  std::vector<int> comp(n, -1);
  std::vector<std::vector<size_t>> out;
  for (size_t i = 0; i < n; ++i) {
    if (comp[i] >= 0) continue;
    const int id = static_cast<int>(out.size());
    out.emplace_back();
    std::vector<size_t> stack{i};
    comp[i] = id;
    while (!stack.empty()) {
      const size_t a = stack.back();
      stack.pop_back();
      for (size_t b = 0; b < n; ++b)
        if (comp[b] < 0 && joined(a, b)) comp[b] = id, stack.push_back(b);
    }
  }
  for (size_t i = 0; i < n; ++i) out[static_cast<size_t>(comp[i])].push_back(i);
  return out;
}

}  // namespace alloy
