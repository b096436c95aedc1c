#pragma once
// Errors carry the context a user needs to fix the problem: which file, which field, which rank.
#include <stdexcept>
#include <string>

namespace alloy {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A problem with user input (config, data file, checkpoint): the message names the file and
// the field at fault.
class InputError : public Error {
 public:
  InputError(const std::string& where, const std::string& msg)
      : Error(where.empty() ? msg : where + ": " + msg), where_(where) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

}  // namespace alloy
