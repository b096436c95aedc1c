#pragma once
// Checks on the errors a reader raises: what a user sees must name the file, field or value at fault.
#include <gtest/gtest.h>

#include <string>

#include "alloy/core/error.h"

namespace alloy::testing {

// The message of the InputError that F throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace alloy::testing

// HAYSTACK (a string or a C string) contains NEEDLE; on failure the whole text is printed.
#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)
