#include "alloy/core/json_file.h"

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

namespace alloy {

nlohmann::json read_json_file(const std::string& path) {
  std::string text = read_file(path);
  // nlohmann parses nesting of any depth, but dump() recurses once per level: 100,000 nested
  // brackets overflow the stack as soon as an error message quotes the value. Alloy's files nest a
  // few levels.
  const auto depth_guard = [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth)
      throw InputError(path, "JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    return true;
  };
  try {
    return nlohmann::json::parse(text, depth_guard);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path, std::string("not valid JSON: ") + e.what());
  }
}

bool is_valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

}  // namespace alloy
