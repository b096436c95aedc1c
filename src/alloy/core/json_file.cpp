#include "alloy/core/json_file.h"

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

namespace alloy {

nlohmann::json read_json_file(const std::string& path) {
  std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path, std::string("not valid JSON: ") + e.what());
  }
}

}  // namespace alloy
