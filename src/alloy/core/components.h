#pragma once
// Connected components of a small graph given by a predicate: the regions of a cluster (devices or
// ranks joined, directly or through each other, by links that are not slow).
#include <cstddef>
#include <functional>
#include <vector>

namespace alloy {

// Components of the graph on 0..N-1 whose edges are the pairs JOINED says; each component's
// members ascending, the components ordered by their first member.
std::vector<std::vector<size_t>> components(size_t n, const std::function<bool(size_t, size_t)>& joined);

}  // namespace alloy
