#pragma once
// Reading a JSON file with the one error every caller wants: the path and the parser's reason.
#include <string>

#include <nlohmann/json.hpp>

namespace alloy {

// Throws InputError naming PATH, also for nesting deeper than kMaxJsonDepth.
nlohmann::json read_json_file(const std::string& path);
inline constexpr int kMaxJsonDepth = 256;

// Whether S is valid UTF-8, so that a JSON document holding it can be written (dump() throws
// otherwise). Text read from YAML or the command line is not checked by its parser.
bool is_valid_utf8(const std::string& s);

}  // namespace alloy
