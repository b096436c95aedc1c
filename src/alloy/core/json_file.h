#pragma once
// Reading a JSON file with the one error every caller wants: the path and the parser's reason.
#include <string>

#include <nlohmann/json.hpp>

namespace alloy {

nlohmann::json read_json_file(const std::string& path);  // throws InputError naming PATH

}  // namespace alloy
